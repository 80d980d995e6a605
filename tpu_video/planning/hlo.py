"""Collectives read from compiled XLA programs, and the per-block measurements built on them.

`count_collectives` reads compiled HLO text (any backend), as does `quantized_reads` (`--quantize`).
`measure` compiles one transformer block at real width (the family's `published_block`: published config,
meta-device weights, no download, the processors stage 2 installs) with the family's rule table;
`measure_text_encoder` does the same for a stage-1 encoder layer.
benchmarks/collectives.py prints these; tests/test_collectives.py holds the counts.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from sharding import DP, SP, TP
from tpu_video import models
from tpu_video.attention.plan import SplashConfig, fixed_plan
from tpu_video.models import cogvideox, hunyuanvideo15
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.workarounds.torchax import import_torchax

torchax = import_torchax()
from torchax import interop  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Ops, tensors (a combined op moves several) and result bytes per device of each collective in
    compiled HLO text (async starts counted once)."""
    found = {name: {"count": 0, "tensors": 0, "bytes": 0} for name in COLLECTIVES}
    for match in _OP.finditer(hlo_text):
        shapes, name = match.groups()
        found[name]["count"] += 1
        for dtype, dims in _SHAPE.findall(shapes):
            found[name]["tensors"] += 1
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            found[name]["bytes"] += size * DTYPE_BYTES.get(dtype, 4)
    return found


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(([^)]*)\)(.*)$")  # tuple types hold spaces
_PARAMETER = re.compile(r"([\w.\-]+): (\w+\[[\d,]*\])")
QUANTIZED_TYPES = ("s8[", "f8e4m3fn[")
_SAME_VALUES = ("bitcast", "copy", "reshape", "transpose", "dynamic-slice", "slice", "broadcast")


def quantized_reads(hlo_text: str) -> dict[str, int]:
    """How compiled HLO text uses int8/e4m3 arrays (`--quantize`): `matmuls`, the dots (a TPU's convolutions)
    that read one as an operand, and `dequantized`, the arrays converted from one to another type that are
    stored: produced outside a fusion or leaving one as its output (a dequantized copy of a weight). A convert
    inside a fusion that reduces it on the spot (a matrix-vector product) stores nothing."""
    computations: dict[str, tuple[dict[str, str], list]] = {}
    fused: set[str] = set()
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), (dict(_PARAMETER.findall(header.group(2))), []))
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is not None and computations:
            root, name, result, op, operands, rest = instruction.groups()
            current[0][name] = result
            current[1].append((bool(root), name, op, re.findall(r"%([\w.\-]+)", operands)))
            if op == "fusion":
                fused.update(re.findall(r"calls=%([\w.\-]+)", rest))
    found = {"matmuls": 0, "dequantized": 0}
    for computation, (types, instructions) in computations.items():
        dequantized: set[str] = set()  # values holding a quantized array's contents in another type
        for root, name, op, operands in instructions:
            quantized = any(types.get(operand, "").startswith(QUANTIZED_TYPES) for operand in operands)
            if op in ("convolution", "dot") and quantized:
                found["matmuls"] += 1
            elif (op == "convert" and quantized) or (op in _SAME_VALUES and dequantized & set(operands)):
                dequantized.add(name)
            if computation in fused and not root:
                continue
            stored = {name} if computation not in fused else set(operands) if op == "tuple" else {name}
            found["dequantized"] += len(stored & dequantized)
    return found


def measure(
    family_name: str, tp_mode: str, mesh, video_tokens: int, attention: str, sp_mode: str = "auto"
) -> dict[str, object]:
    """Collectives of one transformer block of the family's published model (`Family.published_block`; the
    families with one: measured_families()) compiled on `mesh`, with abstract f32 weights placed by the family's rule
    table and inputs laid out as stage 2 lays them; `sp_mode` is how attention uses `sp`
    (attention.sp_modes.SP_MODES); Splash runs with the family's tiles."""
    family = models.FAMILIES[family_name]
    abstract = functools.partial(placement.abstract, mesh=mesh)
    block = family.published_block(video_tokens, 2, abstract)
    table = family.transformer_rules(tp_mode)
    params = dict(block.model.named_parameters())
    prefix = f"{block.blocks}.0."
    specs = {name[len(prefix) :]: spec for name, spec in table.assign(list(params)).items() if name.startswith(prefix)}
    module = getattr(block.model, block.blocks)[0]
    weights = {name: abstract(params[prefix + name].shape, torch.float32, spec) for name, spec in specs.items()}
    video, text = NamedSharding(mesh, P(DP, SP, None)), NamedSharding(mesh, P(DP, None, None))

    def run_block(weights, *inputs):
        return torch.func.functional_call(module, weights, tuple(inputs))

    jitted = jax.jit(interop.jax_view(run_block), out_shardings=(video, text) if block.returns_text else video)
    env = torchax.default_env()
    interpret = jax.devices()[0].platform != "tpu"
    splash = SplashConfig(**family.SPLASH_BLOCK_SIZES, interpret=interpret) if attention == "splash" else None
    heads = block.model.config.num_attention_heads
    plan = fixed_plan(attention, splash, mesh_shape=dict(mesh.shape), heads=heads, sp_mode=sp_mode, tp_mode=tp_mode)
    with env, attention_backend(env, plan, mesh):
        hlo = jitted.lower(weights, *block.inputs).compile().as_text()
    weight_bytes = sum(
        int(np.prod(w.sharding.shard_shape(w.shape))) * w.dtype.itemsize for w in jax.tree.leaves(weights)
    )
    return {
        "model": block.name,
        "tp_mode": tp_mode,
        "mesh": dict(mesh.shape),
        "attention": attention,
        "sp_mode": plan.sequence_parallel,
        "video_tokens": video_tokens,
        "collectives_per_block": {k: v for k, v in count_collectives(hlo).items() if v["count"]},
        "block_weight_bytes_per_device": weight_bytes,
    }


def measured_families() -> tuple[str, ...]:
    """The families whose published_block the collectives count measures (reading it imports each family's
    transformer module, so not at import: every --plan imports this module)."""
    return tuple(name for name, family in models.FAMILIES.items() if family.published_block is not None)


TEXT_ENCODERS = {
    # name: (transformers config class, published config, tokens the pipeline feeds it)
    "t5-xxl": ("T5Config", cogvideox.published.T5_XXL_ENCODER, 226),
    # Qwen2.5-VL: the pipeline's 1000 tokens + the chat template's crop
    "qwen2.5-vl-7b": ("Qwen2_5_VLTextConfig", hunyuanvideo15.published.QWEN25_VL_7B_TEXT, 1000 + 108),
}


def text_encoder_collectives(model_name: str, layers: int, mesh) -> tuple[dict, int, str]:
    """Collectives and weight bytes per device of the whole encoder at `layers` layers, bf16."""
    import transformers

    config_class, config, tokens = TEXT_ENCODERS[model_name]
    layer_key = "num_layers" if config_class == "T5Config" else "num_hidden_layers"
    config = getattr(transformers, config_class)(**{**config, layer_key: layers})
    model_class = transformers.T5EncoderModel if config_class == "T5Config" else transformers.Qwen2_5_VLTextModel
    with torch.device("meta"):
        model = model_class(config).eval()
    table = sharding.text_encoder_rules(config, mesh.shape[TP])
    params = dict(model.named_parameters())
    specs = table.assign(list(params))

    abstract = functools.partial(placement.abstract, mesh=mesh)

    bf16, i32 = jax.numpy.bfloat16, jax.numpy.int32
    weights = {name: abstract(tuple(params[name].shape), bf16, spec) for name, spec in specs.items()}
    buffers = {name: abstract(tuple(b.shape), jax.numpy.float32, P()) for name, b in model.named_buffers()}
    input_ids, mask = abstract((1, tokens), i32, P()), abstract((1, tokens), i32, P())

    def run(weights, buffers, input_ids, mask):
        state = {**weights, **buffers}
        return torch.func.functional_call(model, state, (), {"input_ids": input_ids, "attention_mask": mask})[0]

    jitted = jax.jit(interop.jax_view(run), out_shardings=NamedSharding(mesh, P()))
    with torchax.default_env():
        hlo = jitted.lower(weights, buffers, input_ids, mask).compile().as_text()
    weight_bytes = sum(int(np.prod(w.sharding.shard_shape(w.shape))) * w.dtype.itemsize for w in weights.values())
    return count_collectives(hlo), weight_bytes, table.name


def measure_text_encoder(model_name: str, mesh) -> dict[str, object]:
    """Collectives of one layer of a stage-1 text encoder (TEXT_ENCODERS) and outside its layers: the
    whole encoder compiled at 1 and at 2 layers, the difference being one layer."""
    one, one_bytes, table = text_encoder_collectives(model_name, 1, mesh)
    two, two_bytes, _ = text_encoder_collectives(model_name, 2, mesh)
    per_layer = {name: {key: two[name][key] - one[name][key] for key in one[name]} for name in COLLECTIVES}
    outside = {name: {key: one[name][key] - per_layer[name][key] for key in one[name]} for name in COLLECTIVES}
    return {
        "model": model_name,
        "rule_table": table,
        "mesh": dict(mesh.shape),
        "tokens": TEXT_ENCODERS[model_name][2],
        "collectives_per_layer": {k: v for k, v in per_layer.items() if v["count"]},
        "collectives_outside_layers": {k: v for k, v in outside.items() if v["count"]},
        "layer_weight_bytes_per_device": two_bytes - one_bytes,
    }
