"""LTX-2's text connectors on stage 1's runtime: `LTX2TextConnectors` (the projection of Gemma's stacked
hidden states and the video and audio connector transformers) compiled as one program, weights split over
`tp` by `connector_rules`.

On the host they took about a third of stage 1's time on our 2-core machine (31 s beside Gemma's 68 s for a
prompt and its negative, docs/ltx2.md). Their stock forward runs as it is, with two changes for jit: each connector's
rotary module computes its frequencies in float64 inside `forward`, which JAX drops, so the tables are
computed on the host by that same class `forward` and passed in as inputs; and LTX-2's split rotary embedding
is traced without its in-place update (tpu_video/workarounds/torchax.py: functional_split_rotary).
"""

from __future__ import annotations

import re

import torch

from sharding import COLUMN, COLUMN_BIAS, REPLICATED, ROW, TP, RuleTable, megatron_rules
from tpu_video.attention.plan import AttentionPlan
from tpu_video.engine.encoders import OnRuntime

from .config import TOKENIZER_PADDING_SIDE

CONNECTORS = ("video_connector", "audio_connector")
# The connectors' attention: the attention plan's XLA backend, einsums over the batch and the heads in place.
# torchax 0.0.13's own SDPA lowering multiplies through aten::matmul, which views the [negative, prompt] batch
# and the heads as one dimension; with the heads split over `tp` XLA then gathered every head's q, k and v
# (LTX-2.3 on v6e-8: 48 all-gathers, 576 MiB per call; none with this). Gemma's one prompt per call is unaffected.
XLA_ATTENTION = AttentionPlan("xla")


def connector_rules(config, tp: int) -> RuleTable:
    """LTX2TextConnectors on a mesh with `tp` devices on its `tp` axis, in the Megatron layout. The stacked
    hidden states' projections (LTX-2.0's one `text_proj_in`, 3840 x 188,160; LTX-2.3's one per stream) are
    row-parallel: each device takes its slice of the (replicated) stacked features and one all-reduce sums
    the projection. Column-parallel compiled to more traffic for the TPU (v6e-8, bf16: 210 against 75 MiB for
    LTX-2.0, 1408 against 984 MiB for LTX-2.3; docs/planning.md#ltx-2). Each connector block's MLP is split
    always, its attention where `tp` divides that connector's heads (the published LTX-2.0 has 30: at tp 8
    attention stays replicated; LTX-2.3 has 32). The q/k RMS norms span all heads, so they are split like
    q/k's columns; LTX-2.3's per-head gates like the heads. Replicated: the learnable registers and the
    row-parallel layers' biases."""
    rules = [
        (r"(video_|audio_)?text_proj_in\.weight", ROW),
        (r"(video_|audio_)?text_proj_in\.bias", REPLICATED),  # proj_bias (off in the published configs)
        (r"(video|audio)_connector\.learnable_registers", REPLICATED),
    ]
    optional = {1, 2}
    split = [name for name in CONNECTORS if config[f"{name}_num_attention_heads"] % tp == 0]
    for name in CONNECTORS:
        block = re.escape(name) + r"\.transformer_blocks\.\d+\."
        megatron = megatron_rules(block, r"attn1\.to_[qkv]", r"attn1\.to_out\.0", "ff", "megatron")
        attention, mlp = megatron[:4], megatron[4:]
        norm, gate, gate_bias = (COLUMN_BIAS, COLUMN, COLUMN_BIAS) if name in split else (REPLICATED,) * 3
        if name not in split:
            attention = tuple((pattern, REPLICATED) for pattern, _ in attention)
        optional |= {len(rules) + 5, len(rules) + 6}  # LTX-2.3's gates
        rules += [
            *attention,
            (block + r"attn1\.norm_[qk]\.weight", norm),
            (block + r"attn1\.to_gate_logits\.weight", gate),
            (block + r"attn1\.to_gate_logits\.bias", gate_bias),
            *mlp,
        ]
    layout = "megatron" if len(split) == len(CONNECTORS) else "megatron-mlp"
    return RuleTable(f"ltx2-connectors/{layout}", tuple(rules), frozenset(optional))


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
        from tpu_video.workarounds.torchax import functional_split_rotary

        self.tables = {name: (tables[2 * i], tables[2 * i + 1]) for i, name in enumerate(CONNECTORS)}
        with functional_split_rotary():
            return self.connectors(hidden_states, attention_mask, padding_side=TOKENIZER_PADDING_SIDE)


class DeviceConnectors(OnRuntime):
    """`LTX2TextConnectors` on a runtime, called as the pipeline calls it on its [negative, prompt] batch: CPU
    stacked hidden states and mask in, the video and audio text embeddings and their mask out on the host (the
    mask as the stock module's int64). On a JAX mesh the weights are split by `connector_rules`."""

    def __init__(self, connectors: torch.nn.Module, runtime) -> None:
        config = connectors.config

        def rules(mesh_shape: dict[str, int]) -> RuleTable:
            return connector_rules(config, mesh_shape[TP]).nested("connectors.")

        super().__init__(connectors, runtime, _ConnectorOutputs(connectors), rules)
        self.connectors = [connectors]  # the rotary tables' source (not a submodule)

    def forward(self, hidden_states, attention_mask):
        tables = rope_tables(self.connectors[0], *attention_mask.shape)
        inputs = self.runtime.to_device((hidden_states, attention_mask, *tables))
        with self.runtime.attention(XLA_ATTENTION):
            outputs = self.jitted(*inputs)
        video, audio, mask = (self.runtime.to_host(output) for output in outputs)
        return video, audio, mask.to(torch.int64)
