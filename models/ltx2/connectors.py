"""LTX-2's text connectors on stage 1's runtime: `LTX2TextConnectors` (the projection of Gemma 3's stacked
hidden states and the video and audio connector transformers) compiled as one program, weights replicated.

On the host they took about a third of stage 1's time on our 2-core machine (31 s beside Gemma's 68 s for a
prompt and its negative, docs/ltx2.md). Their stock forward runs as it is, with two changes for jit: each connector's
rotary module computes its frequencies in float64 inside `forward`, which JAX drops, so the tables are
computed on the host by that same class `forward` and passed in as inputs; and LTX-2's split rotary embedding
is traced without its in-place update (workarounds/torchax.py: functional_split_rotary).
"""

from __future__ import annotations

import torch

from ..encoders import OnRuntime
from .config import TOKENIZER_PADDING_SIDE

CONNECTORS = ("video_connector", "audio_connector")


def rope_tables(connectors: torch.nn.Module, batch: int, length: int) -> list[torch.Tensor]:
    """Each connector's (cos, sin) for `batch` sequences of `length` tokens, by the stock rotary class's own
    `forward` on the host (float64 inside, as diffusers computes them)."""
    tables = []
    with torch.no_grad():
        for name in CONNECTORS:
            rope = getattr(connectors, name).rope
            tables.extend(type(rope).forward(rope, batch, length, torch.device("cpu")))
    return tables


class _ConnectorOutputs(torch.nn.Module):
    """The jitted side: the connectors' stock forward, each connector's rotary module returning the tables
    passed in (`forward`'s last four inputs) instead of computing them."""

    def __init__(self, connectors: torch.nn.Module) -> None:
        super().__init__()
        self.connectors = connectors
        self.tables: dict[str, tuple] = {}
        for name in CONNECTORS:

            def given(batch_size, pos, device=None, name=name):
                return self.tables[name]

            getattr(connectors, name).rope.forward = given

    def forward(self, hidden_states, attention_mask, *tables):
        from workarounds.torchax import functional_split_rotary

        self.tables = {name: (tables[2 * i], tables[2 * i + 1]) for i, name in enumerate(CONNECTORS)}
        with functional_split_rotary():
            return self.connectors(hidden_states, attention_mask, padding_side=TOKENIZER_PADDING_SIDE)


class DeviceConnectors(OnRuntime):
    """`LTX2TextConnectors` on a runtime, called as the pipeline calls it on its [negative, prompt] batch: CPU
    stacked hidden states and mask in, the video and audio text embeddings and their mask out on the host (the
    mask as the stock module's int64)."""

    def __init__(self, connectors: torch.nn.Module, runtime) -> None:
        super().__init__(connectors, runtime, _ConnectorOutputs(connectors))
        self.connectors = [connectors]  # the rotary tables' source (not a submodule)

    def forward(self, hidden_states, attention_mask):
        tables = rope_tables(self.connectors[0], *attention_mask.shape)
        outputs = self.jitted(*self.runtime.to_device((hidden_states, attention_mask, *tables)))
        video, audio, mask = (self.runtime.to_host(output) for output in outputs)
        return video, audio, mask.to(torch.int64)
