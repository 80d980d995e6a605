"""LoRA adapters for stage 2 (`--lora PATH[:SCALE]`, and `--lora_2` for Wan 2.2's low-noise expert). Where the
family's loader also adapts a component stage 1 runs (LTX-2's text connectors), stage 1 fuses that share
(tpu_video/engine/lora_stage1.py) and stage 2 checks its adapters against stage 1's record.

Each file is read with the family's diffusers loader (`lora_state_dict`, which converts the community
formats diffusers knows), checked against the transformer's modules before any weights load, then fused
on the host with the transformer's own diffusers methods: `load_lora_adapter`, `set_adapters` with the
scales, `fuse_lora`, `unload_lora`. Fused weights have the base model's shapes, so the compiled step, its
memory and its collectives are the base model's (`--plan` says so and compiles the same graph).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.settings import LORA_FLAGS
from utils import sha256_file

from .lora_files import (
    PREFIX,
    check_fits,
    check_metadata,
    family_loader,
    few_names,
    read_file,
    stage1_component,
    stage1_weights,
    transformer_weights,
)

PLAN_EFFECT = (
    "fused into the weights on the host before placement: same shapes and layouts, so the compiled step, "
    "its HBM and its collectives are those planned for the base model"
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


def read_flag(text: str, flag: str, loader) -> tuple[Path, float, dict[str, torch.Tensor], dict | None]:
    """One `PATH[:SCALE]` flag: the file, its scale, and its weights and metadata as the loader reads them."""
    path, scale = parse_flag(text, flag)
    file = resolve_file(path, flag)
    if file.suffix != ".safetensors":
        raise UserError(f"{flag} {path}: {file.name} is not a .safetensors file")
    return (file, scale, *read_file(loader, file, flag))


def lora_ranks(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each adapted module's rank (its down projection's rows)."""
    down = ".lora_A.weight"
    return {key.removesuffix(down): tensor.shape[0] for key, tensor in weights.items() if key.endswith(down)}


def read_adapters(
    wanted: list[tuple[str, str]],
    family,
    source,
    dtype: torch.dtype,
    stage1: list[dict] | None = None,
    likely_model=None,
) -> list[Adapter]:
    """The adapters `wanted` (`(flag, PATH[:SCALE])` pairs: stages.feature_flags.lora_flags), read and
    checked against the transformers' modules on the meta device (no weights): all errors come before
    anything is loaded or placed. `stage1`: the adapters stage 1 fused into the text connectors (its record;
    None under --plan), which must match stage 2's. `likely_model(file)`: the published model an adapter
    that does not fit was made for, or None (tpu_video.models.adapter_origin; the engine knows no registry)."""
    from tpu_video.engine.meta import meta_transformers

    if not wanted:
        check_stage2_share(stage1 or [], [])
        return []
    components = family.transformer_components(source)
    if any(flag == "--lora_2" for flag, _ in wanted) and "transformer_2" not in components:
        raise UserError(f"--lora_2 adapts Wan 2.2's transformer_2; {source.ref!r} has one transformer (use --lora)")
    loader, in_stage1 = family_loader(family), stage1_component(family)
    transformers = meta_transformers(family, source, dtype)
    adapters = []
    for flag, text in wanted:
        file, scale, state_dict, metadata = read_flag(text, flag, loader)
        weights, prefix, others = transformer_weights(state_dict)
        sha = sha256_file(file)
        stage1_share = stage1_weights(state_dict, in_stage1)
        if stage1_share:
            check_stage1_share(stage1, len(stage1_share), sha, scale, flag, file)
            others = [key for key in others if key.split(".")[0] != in_stage1]
            if not weights:
                log(f"{flag} {file.name}: only text-connector weights, fused by stage 1; nothing for the transformer")
                continue
        component = LORA_FLAGS[flag]
        modules = dict(transformers[component].named_modules())
        missing = check_fits(weights, modules, flag, file) if weights else ["(none)"]
        if missing:
            made_for = likely_model(file) if likely_model is not None else None
            looks = f"they look made for {made_for}" if made_for else "no supported model has them"
            raise UserError(
                f"{flag} {file.name}: {len(missing)} of its modules are not in this {family.NAME} {component} "
                f"({few_names(missing)}); {looks}"
            )
        ranks = lora_ranks(weights)
        check_metadata(metadata, prefix, ranks, flag, file)
        if others:
            log(f"{flag} {file.name}: {len(others)} keys of other components left alone ({few_names(others, 2)})")
        if loader is not None and prefix is None:
            log(f"{flag} {file.name}: keys without the '{PREFIX}.' prefix, taken as the transformer's")
        adapters.append(Adapter(flag, component, file, scale, sha, state_dict, metadata, prefix))
        log(f"{flag} {file.name}: {len(ranks)} modules of {component}, rank {max(ranks.values())}, scale {scale:g}")
    check_stage2_share(stage1 or [], adapters)
    return adapters


def check_stage1_share(stage1: list[dict] | None, count: int, sha: str, scale: float, flag: str, file: Path) -> None:
    """An adapter with `count` weights for the stage-1 component: stage 1 must have fused them, at this scale
    (`stage1`: its record; None under --plan, which compiles the transformer alone)."""
    if stage1 is None:
        return
    fused = [record for record in stage1 if record["sha256"] == sha]
    if not any(record["scale"] == scale for record in fused):
        said = f"stage 1 fused them at scale {fused[0]['scale']:g}" if fused else "stage 1 fused none of them"
        raise UserError(
            f"{flag} {file.name}: {count} of its weights adapt the text connectors, which stage 1 runs, and {said}; "
            f"give stage 1 the same --lora {file.name}:{scale:g} and rerun it"
        )


def check_stage2_share(stage1: list[dict], adapters: list[Adapter]) -> None:
    """Every adapter stage 1 fused that also has transformer weights is among stage 2's, at the same scale."""
    given = {(adapter.sha256, adapter.scale) for adapter in adapters}
    for record in stage1:
        if record["transformer_weights"] and (record["sha256"], record["scale"]) not in given:
            raise UserError(
                f"stage 1 fused {record['file']}'s text-connector weights at scale {record['scale']:g}: give stage 2 "
                f"the same --lora {record['file']}:{record['scale']:g} for its {record['transformer_weights']} "
                "transformer weights"
            )


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
