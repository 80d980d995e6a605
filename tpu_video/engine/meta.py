"""Components built from their configs on the meta device (shapes and dtypes, no weights), and what the
mesh choice needs to know of them. `--plan` compiles around these modules; every stage-2 run and plan
asks `model_facts` before choosing its default mesh (runtime.mesh.default_mesh), so the choice costs no
weights and no compile.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

import torch

from sharding import TP
from tpu_video.engine.quantize import quantize
from tpu_video.engine.settings import NO_QUANTIZATION, Quantization
from tpu_video.runtime.mesh import ModelFacts


def attention_heads(source) -> int:
    """The transformer's attention head count (what `tp` must divide), from its config alone."""
    return source.load_config("transformer")["num_attention_heads"]


def meta_module(source, component: str, dtype: torch.dtype, **overrides) -> torch.nn.Module:
    """A component built from its config on the meta device (no weights), in `dtype` as `from_pretrained`
    would load it (modules the class keeps in fp32 stay fp32)."""
    cls = source.component_class(component)
    with torch.device("meta"):
        module = cls.from_config({**source.load_config(component), **overrides}).eval()
    torch.nn.Module.to(module, dtype)  # the plain cast: diffusers' own `to` only warns about fp32 modules
    # from_pretrained keeps a tensor in fp32 when any part of its name is listed (a module or a parameter,
    # e.g. Wan's per-block `scale_shift_table`).
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if keep & set(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32)
    return module


def meta_pretrained(source, component: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A transformers model (a text or image encoder) on the meta device, loaded by its own `from_pretrained`
    from its config alone (an empty state dict: configs suffice, so a published pipeline's configs kept in code
    plan as its downloaded folder does): fp32 modules kept and every attribute a load sets, so its programs key
    as a run's (tests/test_plan_executables.py)."""
    from transformers.utils import logging

    cls = source.component_class(component)
    config = cls.config_class.from_pretrained(source.location, subfolder=component)
    kwargs = {} if dtype is None else {"dtype": dtype}
    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # its report lists every weight as missing: all are, by design
    logging.disable_progress_bar()  # and counts none loaded
    try:
        return cls.from_pretrained(None, config=config, state_dict={}, device_map="meta", **kwargs).eval()
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def meta_transformers(
    family, source, dtype: torch.dtype, num_layers: int | None = None, quantization: Quantization = NO_QUANTIZATION
) -> dict[str, torch.nn.Module]:
    """Every transformer the family's stage 2 loads, on the meta device (at `num_layers` blocks if given),
    quantized as `quantization` (an engine.settings.Quantization) says."""
    modules = {}
    for name in family.transformer_components(source):
        overrides = {} if num_layers is None else family.depth_overrides(source, name, num_layers)
        modules[name] = meta_module(source, name, dtype, **overrides)
    quantize(modules, quantization)
    return modules


def weight_facts(modules: Iterable[torch.nn.Module], rules, heads: int) -> ModelFacts:
    """The modules' weight bytes by how `rules` (a sharding.RuleTable) lays them out: split on tp (by the
    size of the split dimension) or replicated. Buffers are replicated, as placement.place_module places them."""
    split: dict[int, int] = defaultdict(int)
    replicated = 0
    for module in modules:
        specs = rules.assign([name for name, _ in module.named_parameters()])
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            size = tensor.numel() * tensor.element_size()
            dims = [dim for dim, axes in enumerate(specs.get(name, ())) if axes == TP]
            if dims:
                split[tensor.shape[dims[0]]] += size
            else:
                replicated += size
    return ModelFacts(heads, tuple(sorted(split.items())), replicated)


def model_facts(
    family, source, dtype: torch.dtype, tp_mode: str, request=None, quantization: Quantization = NO_QUANTIZATION
) -> ModelFacts:
    """What the default mesh needs of the family's stage-2 transformers (all experts: each stays resident;
    quantized as `quantization` says) and, given the request, of one sample's activations."""
    modules = meta_transformers(family, source, dtype, quantization=quantization).values()
    facts = weight_facts(modules, family.transformer_rules(tp_mode), attention_heads(source))
    if request is None:
        return facts
    return dataclasses.replace(facts, activations=family.activations(source, request, dtype))
