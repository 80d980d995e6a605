"""Reading one LoRA adapter file and checking it against the transformer before any weights load: every
tensor finite and its metadata JSON, the family's diffusers loader (`lora_state_dict`, which converts the
community formats diffusers knows), the transformer's share of the keys, every weight's module, rank and
shape, the metadata's rank, and, where the keys do not fit, the published model the file was most likely
made for.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import torch

from tpu_video.cli import UserError
from utils import non_finite_keys

# A PEFT LoRA weight: `<module>.lora_A.weight` (down), `<module>.lora_B.weight` (up), `<module>.lora_B.bias`.
LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?P<param>weight|bias)$")
PREFIX = "transformer"  # diffusers' key prefix for a pipeline's transformer weights


def read_file(loader, file: Path, flag: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The file through the family's diffusers loader (None: a plain read, diffusers/PEFT keys only),
    after its own checks: a readable header, every tensor finite, metadata that is a JSON object of finite
    numbers. Whatever the loader's converters raise on a malformed file is one error naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as handle:  # header and sizes checked before anything else reads it
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            metadata = _metadata(handle.metadata(), flag, file)
    except (SafetensorError, OSError) as err:
        raise UserError(f"{flag} {file}: not a readable .safetensors file (truncated?): {err}") from None
    for key, tensor in tensors.items():  # the file's own keys (Wan's alpha too), before a converter uses them
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(f"{flag} {file.name}: {key} holds NaN or Inf")
    if loader is None:
        return tensors, metadata
    try:  # use_safetensors=True: diffusers would otherwise fall back to unpickling a file it cannot read
        return loader.lora_state_dict(str(file), use_safetensors=True, return_lora_metadata=True)
    except Exception as err:  # its converters index keys and shapes they expect (KeyError, IndexError, ...)
        raise UserError(
            f"{flag} {file.name}: diffusers' {loader.__name__} cannot read it ({type(err).__name__}: {err})"
        ) from None


def _metadata(header: dict[str, str] | None, flag: str, file: Path) -> dict | None:
    """The adapter's configuration diffusers saved in the header (None: none), checked as JSON."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    raw = (header or {}).get(LORA_ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"{flag} {file.name}: its {LORA_ADAPTER_METADATA_KEY} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} {file.name}: its {LORA_ADAPTER_METADATA_KEY} is not a JSON object")
    bad = non_finite_keys(value)
    if bad:
        raise UserError(
            f"{flag} {file.name}: its {LORA_ADAPTER_METADATA_KEY} holds NaN or Infinity at {few_names(bad)}"
        )
    return value


def check_metadata(metadata: dict | None, prefix: str | None, ranks: dict[str, int], flag: str, file: Path) -> None:
    """What diffusers builds the adapter's `LoraConfig` from: the transformer's keys (`transformer.r`, ...)
    and a rank `r` the tensors have (with no `rank_pattern`), else fusing fails after the weights loaded."""
    if metadata is None:
        return
    if prefix is not None:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
        if not metadata:
            raise UserError(f"{flag} {file.name}: its metadata names nothing of the '{prefix}.' (keys without it)")
    rank = metadata.get("r", 8)  # peft.LoraConfig's default r
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"{flag} {file.name}: its metadata's r is {rank!r}, not a positive integer")
    if not metadata.get("rank_pattern"):
        other = sorted({name for name, size in ranks.items() if size != rank})
        if other:
            raise UserError(
                f"{flag} {file.name}: its metadata says rank {rank}, but {few_names(other)} have rank {ranks[other[0]]}"
            )


def family_loader(family):
    """The diffusers class whose `lora_state_dict` reads this family's adapter files, or None."""
    if family.LORA_LOADER is None:
        return None
    return getattr(importlib.import_module("diffusers.loaders"), family.LORA_LOADER)


def transformer_weights(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None, list[str]]:
    """The transformer's keys as `load_lora_adapter` sees them, its prefix, and the keys of other components
    (a text encoder's, which stage 2 leaves alone, as diffusers' video pipelines do)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    if any(key.startswith(f"{PREFIX}.") for key in state_dict):
        prefix = PREFIX
        ours = {key.removeprefix(f"{PREFIX}."): v for key, v in state_dict.items() if key.startswith(f"{PREFIX}.")}
        others = [key for key in state_dict if not key.startswith(f"{PREFIX}.")]
    else:
        prefix, ours, others = None, dict(state_dict), []
    if ours and "lora_A" not in next(iter(ours)):  # load_lora_adapter's own test for the older diffusers keys
        ours = convert_unet_state_dict_to_peft(ours)
    return ours, prefix, others


def check_fits(weights: dict[str, torch.Tensor], modules: dict[str, torch.nn.Module], flag: str, file: Path) -> list:
    """Refuse keys that are not LoRA weights, and weights whose shapes do not fit their module. Returns the
    module names the adapter names that this transformer lacks."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    strays = []
    for key, tensor in weights.items():
        match = LORA_KEY.match(key)
        if match is None:
            strays.append(key)
        else:
            pairs.setdefault(match["module"], {})[f"{match['part']}.{match['param']}"] = tensor
    if strays:
        raise UserError(f"{flag} {file.name}: keys that are not LoRA weights (lora_A/lora_B): {few_names(strays)}")
    missing = [name for name in pairs if name not in modules]
    for name, parts in pairs.items():
        if name in missing:
            continue
        module = modules[name]
        if isinstance(module, torch.nn.Linear):
            size_in, size_out = module.in_features, module.out_features
        elif isinstance(module, torch.nn.modules.conv._ConvNd):
            size_in, size_out = module.in_channels, module.out_channels
        else:
            raise UserError(f"{flag} {file.name}: {name} is a {type(module).__name__}, not a linear or conv layer")
        down, up, bias = parts.get("lora_A.weight"), parts.get("lora_B.weight"), parts.get("lora_B.bias")
        if down is None or up is None:
            raise UserError(f"{flag} {file.name}: {name} has only one of lora_A and lora_B")
        if "lora_A.bias" in parts:
            raise UserError(f"{flag} {file.name}: {name}.lora_A.bias: LoRA's down projection has no bias")
        dims = module.weight.ndim
        for part, tensor in (("lora_A", down), ("lora_B", up)):
            if tensor.ndim != dims:
                raise UserError(
                    f"{flag} {file.name}: {name}.{part}.weight is {tensor.ndim}-D {tuple(tensor.shape)}; "
                    f"a {type(module).__name__}'s LoRA weights are {dims}-D"
                )
        if down.shape[1] != size_in or up.shape[0] != size_out or down.shape[0] != up.shape[1]:
            raise UserError(
                f"{flag} {file.name}: {name} ({size_in} in, {size_out} out) does not fit the adapter's lora_A "
                f"{tuple(down.shape)} and lora_B {tuple(up.shape)} (rank {down.shape[0]}); an adapter for "
                "another size of this model?"
            )
        if bias is not None and tuple(bias.shape) != (size_out,):
            raise UserError(
                f"{flag} {file.name}: {name}.lora_B.bias is {tuple(bias.shape)}; the layer has {size_out} outputs"
            )
    return missing


def few_names(names: list[str], count: int = 3) -> str:
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return ", ".join(names[:count]) + more


def stage1_component(family) -> str | None:
    """The component stage 1 runs that the family's diffusers loader also adapts (LTX-2: "connectors"), or None."""
    loader = family_loader(family)
    loadable = [name for name in getattr(loader, "_lora_loadable_modules", ()) if not name.startswith("transformer")]
    return loadable[0] if loadable else None


def stage1_weights(state_dict: dict[str, torch.Tensor], component: str | None) -> dict[str, torch.Tensor]:
    """The adapter's weights for the stage-1 component, as load_lora_adapter sees them (prefix removed)."""
    if component is None:
        return {}
    return {key.removeprefix(f"{component}."): v for key, v in state_dict.items() if key.startswith(f"{component}.")}
