"""Which published model an adapter file was made for: the model whose transformer has most of the modules
the file's keys name (after that model's family loader converted them). The engine's `--lora` check names it
when an adapter does not fit (tpu_video.engine.lora.read_adapters takes this function)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tpu_video import models
from tpu_video.engine.lora_files import (
    LORA_KEY,
    family_loader,
    read_file,
    transformer_weights,
)
from tpu_video.engine.meta import meta_transformers


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", name)


def likely_model(file: Path) -> str | None:
    """The published model (hub id) whose transformer has most of the modules the file's keys name, after
    that model's family loader converted them (over half, else None): named when the keys do not fit."""
    best, best_share, names_by_family = None, 0.5, {}
    for hub_id in models.PUBLISHED:
        source, family = models.resolve_model(hub_id, configs_only=True)
        if family.NAME not in names_by_family:
            try:
                weights = transformer_weights(read_file(family_loader(family), file, "--lora")[0])[0]
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
