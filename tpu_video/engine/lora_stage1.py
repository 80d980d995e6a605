"""Stage 1's LoRA adapters: where the family's diffusers loader also adapts a component stage 1 runs (LTX-2's
text connectors), stage 1's `--lora` reads each file's share for it, fuses it before encoding (the same
diffusers calls as stage 2's, tpu_video/engine/lora.py) and records the adapters, which stage 2 checks its own against.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError, log
from utils import sha256_file

from .lora import Adapter, fuse, lora_ranks, read_flag
from .lora_files import (
    check_fits,
    check_metadata,
    family_loader,
    few_names,
    stage1_component,
    stage1_weights,
)


def read_adapters(texts: list[str], family, source, dtype: torch.dtype) -> list[Adapter]:
    """Stage 1's `--lora` flags: each file's weights for the stage-1 component its family's loader adapts
    (LTX-2's text connectors), checked against that module on the meta device before any weights load. A file
    without any is stage 2's alone (logged, not kept)."""
    from tpu_video.engine.meta import meta_module

    if not texts:
        return []
    component = stage1_component(family)
    if component is None:
        raise UserError(f"--lora in stage 1: {family.NAME} adapters change the transformer alone; give them to stage 2")
    loader, module = family_loader(family), meta_module(source, component, dtype)
    adapters = []
    for text in texts:
        file, scale, state_dict, metadata = read_flag(text, "--lora", loader)
        weights = stage1_weights(state_dict, component)
        if not weights:
            log(f"--lora {file.name}: nothing for the {component}; stage 2 fuses it into the transformer")
            continue
        missing = check_fits(weights, dict(module.named_modules()), "--lora", file)
        if missing:
            raise UserError(f"--lora {file.name}: {few_names(missing)} are not in this {family.NAME} {component}")
        ranks = lora_ranks(weights)
        check_metadata(metadata, component, ranks, "--lora", file)
        adapter = Adapter("--lora", component, file, scale, sha256_file(file), state_dict, metadata, component)
        adapters.append(adapter)
        log(f"--lora {file.name}: {len(ranks)} modules of the {component}, scale {scale:g}")
        others = record(adapter)["transformer_weights"]
        if others:
            log(f"--lora {file.name}: give stage 2 the same --lora for its {others} transformer weights")
    return adapters


def record(adapter: Adapter) -> dict[str, Any]:
    """What stage 1 records of an adapter it fused (stage 2 checks it against its own --lora)."""
    transformer_share = sum(not key.startswith(f"{adapter.transformer}.") for key in adapter.state_dict)
    return {**adapter.record(), "transformer_weights": transformer_share}


class AdaptedSource:
    """A models.ModelSource whose `load` fuses stage 1's adapters into the component they adapt (LTX-2's text
    connectors), as the pipeline's `load_lora_weights` and `set_adapters` would apply them."""

    def __init__(self, source, adapters: list[Adapter], family) -> None:
        self.source, self.adapters, self.family = source, adapters, family

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def load(self, component: str, dtype=None):
        module = self.source.load(component, dtype)
        if any(adapter.transformer == component for adapter in self.adapters):
            fuse({component: module}, self.adapters, self.family)
        return module
