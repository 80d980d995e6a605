"""LoRA adapters for stage 2 (`--lora PATH[:SCALE]`, and `--lora_2` for Wan 2.2's low-noise expert).

Each file is read with the family's diffusers loader (`lora_state_dict`, which converts the community
formats diffusers knows), checked against the transformer's modules before any weights load, then fused
on the host with the transformer's own diffusers methods: `load_lora_adapter`, `set_adapters` with the
scales, `fuse_lora`, `unload_lora`. Fused weights have the base model's shapes, so the compiled step, its
memory and its collectives are the base model's (`--plan` says so and compiles the same graph).
"""

from __future__ import annotations

import importlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from utils import UserError, log, sha256_file

# The flags, and the transformer component each one adapts.
FLAGS = {"--lora": "transformer", "--lora_2": "transformer_2"}
# A PEFT LoRA weight: `<module>.lora_A.weight` (down), `<module>.lora_B.weight` (up), `<module>.lora_B.bias`.
LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?P<param>weight|bias)$")
PREFIX = "transformer"  # diffusers' key prefix for a pipeline's transformer weights
PLAN_EFFECT = (
    "fused into the weights on the host before placement: same shapes and layouts, so the compiled step, "
    "its HBM and its collectives are those planned for the base model"
)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("LoRA adapters (fused into the weights before placement; docs/lora.md)")
    group.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA adapter for the transformer (Wan 2.2: the high-noise expert): a .safetensors file, a folder "
        "holding one, or a hub id org/name[/file.safetensors]; SCALE any finite number (default 1.0); repeatable",
    )
    group.add_argument(
        "--lora_2",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="Wan 2.2 A14B: a LoRA adapter for transformer_2, the low-noise expert; repeatable",
    )


@dataclass(frozen=True)
class Adapter:
    """One adapter as stage 2 fuses it: the transformer's LoRA weights, in diffusers' layout."""

    flag: str
    transformer: str
    file: Path
    scale: float
    sha256: str
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any] | None
    prefix: str | None  # load_lora_adapter's prefix: "transformer", or None for bare PEFT keys

    def record(self) -> dict[str, Any]:
        """What the stage-2 section records (and the checkpoint fingerprint and MagCache ratios compare)."""
        return {"file": self.file.name, "sha256": self.sha256, "scale": self.scale, "transformer": self.transformer}


def identity(adapters) -> list[dict[str, Any]]:
    """What makes two runs' adapters the same: contents, scale and transformer (not the file's name)."""
    return [{key: value for key, value in a.record().items() if key != "file"} for a in adapters]


def parse_flag(text: str, flag: str) -> tuple[str, float]:
    """`PATH[:SCALE]`: the scale is what follows the last colon when that parses as a number."""
    path, colon, tail = text.rpartition(":")
    if not colon:
        return text, 1.0
    try:
        scale = float(tail)
    except ValueError:
        return text, 1.0
    if not math.isfinite(scale):
        raise UserError(f"{flag} {text}: the scale {tail} is not a finite number")
    return path, scale


def resolve_file(path: str, flag: str) -> Path:
    """A local .safetensors file, a folder holding exactly one, or a hub id `org/name[/file.safetensors]`
    fetched through huggingface_hub (its cache and HF_HUB_OFFLINE apply, as for models)."""
    if os.path.isfile(path):
        return Path(path)
    if os.path.isdir(path):
        return _only_safetensors(sorted(p.name for p in Path(path).iterdir()), path, flag, Path(path))
    parts = path.split("/")
    if path.startswith(("/", ".", "~")) or len(parts) < 2 or not all(parts):
        raise UserError(f"{flag} {path}: no such file or folder (nor an org/name hub id)")
    from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download

    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        if not filename:
            if constants.HF_HUB_OFFLINE:  # the cached snapshot's files
                folder = Path(snapshot_download(repo, allow_patterns=["*.safetensors"], local_files_only=True))
                names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.safetensors"))
            else:
                names = list_repo_files(repo)
            filename = str(_only_safetensors(names, path, flag, Path()))
        return Path(hf_hub_download(repo, filename))
    except UserError:
        raise
    except Exception as err:  # the hub client raises many types; any of them means "cannot fetch"
        raise UserError(f"{flag} {path}: cannot fetch from the hub ({type(err).__name__}: {err})") from None


def _only_safetensors(names: list[str], path: str, flag: str, folder: Path) -> Path:
    found = [name for name in names if name.endswith(".safetensors")]
    if len(found) != 1:
        listed = ", ".join(found) if found else "none"
        raise UserError(f"{flag} {path}: holds {len(found)} .safetensors files ({listed}); name one")
    return folder / found[0]


def _read(loader, file: Path, flag: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The file through the family's diffusers loader (None: a plain read, diffusers/PEFT keys only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as handle:  # header and sizes checked before anything else reads it
            handle.keys()
        if loader is None:
            from diffusers.utils.state_dict_utils import _load_sft_state_dict_metadata
            from safetensors.torch import load_file

            return load_file(str(file)), _load_sft_state_dict_metadata(str(file))
        # use_safetensors=True: diffusers would otherwise fall back to unpickling a file it cannot read
        return loader.lora_state_dict(str(file), use_safetensors=True, return_lora_metadata=True)
    except (SafetensorError, OSError) as err:
        raise UserError(f"{flag} {file}: not a readable .safetensors file (truncated?): {err}") from None


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
        raise UserError(f"{flag} {file.name}: keys that are not LoRA weights (lora_A/lora_B): {_few(strays)}")
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
        down, up = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if down is None or up is None:
            raise UserError(f"{flag} {file.name}: {name} has only one of lora_A and lora_B")
        if down.shape[1] != size_in or up.shape[0] != size_out or down.shape[0] != up.shape[1]:
            raise UserError(
                f"{flag} {file.name}: {name} ({size_in} in, {size_out} out) does not fit the adapter's lora_A "
                f"{tuple(down.shape)} and lora_B {tuple(up.shape)} (rank {down.shape[0]}); an adapter for "
                "another size of this model?"
            )
    return missing


def _few(names: list[str], count: int = 3) -> str:
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return ", ".join(names[:count]) + more


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", name)


def likely_model(file: Path) -> str | None:
    """The published model (hub id) whose transformer has most of the modules the file's keys name, after
    that model's family loader converted them (over half, else None): named when the keys do not fit."""
    import models
    from models.meta import meta_transformers

    best, best_share, names_by_family = None, 0.5, {}
    for hub_id in models.PUBLISHED:
        source, family = models.resolve_model(hub_id, configs_only=True)
        if family.NAME not in names_by_family:
            try:
                weights = transformer_weights(_read(family_loader(family), file, "--lora")[0])[0]
            except Exception:  # a loader whose converter does not take these keys
                weights = {}
            names_by_family[family.NAME] = {match["module"] for match in map(LORA_KEY.match, weights) if match}
        names = names_by_family[family.NAME]
        if not names:
            continue
        transformer = meta_transformers(family, source, torch.float32, num_layers=1)["transformer"]
        modules = {_pattern(name) for name, _ in transformer.named_modules()}
        share = sum(_pattern(name) in modules for name in names) / max(len(names), 1)
        if share > best_share:
            best, best_share = f"{hub_id} ({family.NAME})", share
    return best


def read_adapters(args, family, source, dtype: torch.dtype) -> list[Adapter]:
    """Every `--lora`/`--lora_2` flag, read and checked against the transformers' modules on the meta
    device (no weights): all errors come before anything is loaded or placed."""
    from models.meta import meta_transformers

    wanted = [(flag, text) for flag in FLAGS for text in getattr(args, flag.lstrip("-"))]
    if not wanted:
        return []
    components = family.transformer_components(source)
    if args.lora_2 and "transformer_2" not in components:
        raise UserError(f"--lora_2 adapts Wan 2.2's transformer_2; {source.ref!r} has one transformer (use --lora)")
    loader = family_loader(family)
    transformers = meta_transformers(family, source, dtype)
    adapters = []
    for flag, text in wanted:
        path, scale = parse_flag(text, flag)
        file = resolve_file(path, flag)
        if file.suffix != ".safetensors":
            raise UserError(f"{flag} {path}: {file.name} is not a .safetensors file")
        state_dict, metadata = _read(loader, file, flag)
        weights, prefix, others = transformer_weights(state_dict)
        component = FLAGS[flag]
        modules = dict(transformers[component].named_modules())
        missing = check_fits(weights, modules, flag, file) if weights else ["(none)"]
        if missing:
            made_for = likely_model(file)
            looks = f"they look made for {made_for}" if made_for else "no supported model has them"
            raise UserError(
                f"{flag} {file.name}: {len(missing)} of its modules are not in this {family.NAME} {component} "
                f"({_few(missing)}); {looks}"
            )
        if others:
            log(f"{flag} {file.name}: {len(others)} keys of other components left alone ({_few(others, 2)})")
        if loader is not None and prefix is None:
            log(f"{flag} {file.name}: keys without the '{PREFIX}.' prefix, taken as the transformer's")
        sha = sha256_file(file)
        adapters.append(Adapter(flag, component, file, scale, sha, state_dict, metadata, prefix))
        rank = max((t.shape[0] for k, t in weights.items() if k.endswith("lora_A.weight")), default=0)
        log(f"{flag} {file.name}: {len(weights) // 2} modules of {component}, rank {rank}, scale {scale:g}")
    return adapters


def fuse(transformers: dict[str, torch.nn.Module], adapters: list[Adapter], family) -> None:
    """Fuse each transformer's adapters into its weights with diffusers' model methods, then drop the
    adapter layers: the module is the stock class again, with changed weights."""
    loader = family_loader(family)
    expand = getattr(loader, "_maybe_expand_t2v_lora_for_i2v", None)  # Wan: T2V adapters on I2V models
    for component, transformer in transformers.items():
        mine = [adapter for adapter in adapters if adapter.transformer == component]
        if not mine:
            continue
        names = [f"adapter_{index}" for index in range(len(mine))]
        for name, adapter in zip(names, mine, strict=True):
            state_dict = dict(adapter.state_dict)
            if expand is not None and adapter.prefix == PREFIX:
                state_dict = expand(transformer=transformer, state_dict=state_dict)
            transformer.load_lora_adapter(
                state_dict, prefix=adapter.prefix, adapter_name=name, metadata=adapter.metadata
            )
        transformer.set_adapters(names, [adapter.scale for adapter in mine])
        transformer.fuse_lora(adapter_names=names)
        transformer.unload_lora()
        log(f"fused {len(mine)} LoRA adapter(s) into {component}")
