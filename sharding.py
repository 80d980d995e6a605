"""The dp/sp/tp mesh's axis names and shapes, and the weight rule tables: how a table is written and
checked, the Megatron block layout every transformer table uses, and the text encoders' tables (T5/UMT5,
Qwen2.5-VL; each family's transformer table is in its package, `tpu_video/models/<family>/transformer.py`). No JAX:
a layout is a tuple of axis names (or None) per dimension; the runtime (tpu_video/runtime/placement.py) turns
layouts into JAX shardings at its edge, so the planner's arithmetic, the attention plan and stages 1 and 3
with `--backend torch` read these without JAX.

Mesh axes, outermost first: `dp` (the two classifier-free-guidance branches, or more batch), `sp`
(the query sequence inside attention, and the token axis between blocks), `tp` (attention heads and
MLP columns). `tp` is innermost so its traffic stays between neighbouring chips.

A rule table is an ordered list of (regex, layout) over parameter names; the first match wins.
`REPLICATED` (the empty layout) marks a weight as deliberately replicated. Every parameter must match a
rule and every rule must match a parameter, so a renamed layer cannot silently fall back to replication.

Weights use the Megatron layout: column-parallel inputs (q/k/v, MLP in: torch's (out, in) weight split
on `out`) and row-parallel outputs (attention out, MLP out: split on `in`), which costs one all-reduce
after attention and one after the MLP per block, plus a small one per AdaLN modulation (MODULATION).
`--tp_mode replicated_out` keeps the row-parallel outputs replicated instead: more memory, and under
XLA's partitioner no fewer collectives (benchmarks/collectives.py measures both).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

# The mesh's axis names, outermost first. Layouts everywhere (rule tables, activation constraints, the
# Splash shard_map) name axes through these constants.
DP, SP, TP = AXES = ("dp", "sp", "tp")

Layout = tuple  # axis names (a str, a tuple of them, or None) per dimension; missing trailing ones: None


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    sp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.sp * self.tp

    def as_dict(self) -> dict[str, int]:
        return {DP: self.dp, SP: self.sp, TP: self.tp}

    def __str__(self) -> str:
        return f"dp {self.dp} x sp {self.sp} x tp {self.tp}"


TP_MODES = ("megatron", "replicated_out")
REPLICATED: Layout = ()
COLUMN: Layout = (TP, None)  # torch Linear weight (out, in): output features split
COLUMN_BIAS: Layout = (TP,)
ROW: Layout = (None, TP)  # input features split; the partial sums are all-reduced
# AdaLN modulation linears (timestep embedding -> 6 x width of shifts, scales, gates per block) are a
# large share of the weights (HunyuanVideo-1.5: 2.7 B of 8.3 B parameters) but act on one vector per
# sample: split on their input, each costs one all-reduce of (batch, 6 x width), a few hundred KiB.
MODULATION = ROW


# Rule tables ---------------------------------------------------------------------------------------

SCALE_SUFFIX = ".weight_scale"  # a quantized linear's per-output-channel scales (tpu_video/engine/quantize.py)


@dataclass(frozen=True)
class RuleTable:
    name: str
    rules: tuple[tuple[str, Layout], ...]
    optional: frozenset[int] = frozenset()  # indices of rules only some variants use (may match nothing)
    # names of tensors that hold several blocks' weights stacked along a new first dimension
    # (tpu_video/engine/scanned_blocks.py): laid out as their rule says for one block, the stacked dimension whole
    stacked: frozenset[str] = frozenset()

    def nested(self, prefix: str) -> RuleTable:
        """The same rules for the model mounted as submodule `prefix` (e.g. "transformer.")."""
        rules = tuple((re.escape(prefix) + pattern, spec) for pattern, spec in self.rules)
        return RuleTable(self.name, rules, self.optional, frozenset(prefix + name for name in self.stacked))

    def with_stacked(self, names) -> RuleTable:
        """The same rules, with `names` holding stacked blocks (see `stacked`)."""
        return replace(self, stacked=self.stacked | frozenset(names))

    def spec_for(self, param_name: str) -> tuple[int, Layout] | None:
        for index, (pattern, spec) in enumerate(self.rules):
            if re.fullmatch(pattern, param_name):
                return index, spec
        return None

    def assign(self, names: Sequence[str]) -> dict[str, Layout]:
        """Each parameter's spec; raises ValueError on an unmatched parameter or an unused rule. A quantized
        linear's `weight_scale` (one per output channel) is laid out as its weight's output dimension."""
        specs, used = {}, set()
        unmatched = []
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                found = self.spec_for(name.removesuffix(SCALE_SUFFIX) + ".weight")
                found = found and (found[0], found[1][:1])
            else:
                found = self.spec_for(name)
            if found is None:
                unmatched.append(name)
                continue
            used.add(found[0])
            specs[name] = (None, *found[1]) if name in self.stacked else found[1]
        unused = [pattern for index, (pattern, _) in enumerate(self.rules) if index not in used | self.optional]
        if unmatched or unused:
            raise ValueError(
                f"rule table {self.name!r} does not fit the model: "
                f"parameters without a rule {unmatched[:5]}{'...' if len(unmatched) > 5 else ''}, "
                f"rules that match nothing {unused}"
            )
        return specs


def megatron_rules(prefix: str, attn_in: str, attn_out: str, mlp: str, tp_mode: str) -> tuple:
    """The eight rules of one Megatron block: q/k/v (`attn_in`) and MLP-in column-parallel, attention-out
    (`attn_out`) and MLP-out row-parallel (replicated under tp_mode "replicated_out"). Patterns are regexes
    after `prefix`; `mlp` names the FeedForward module(s) (diffusers' `net.0.proj` in, `net.2` out)."""
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode {tp_mode!r} is not one of {TP_MODES}")
    row, row_bias = (ROW, REPLICATED) if tp_mode == "megatron" else (REPLICATED, REPLICATED)
    return (
        (prefix + attn_in + r"\.weight", COLUMN),
        (prefix + attn_in + r"\.bias", COLUMN_BIAS),
        (prefix + attn_out + r"\.weight", row),
        (prefix + attn_out + r"\.bias", row_bias),
        (prefix + mlp + r"\.net\.0\.proj\.weight", COLUMN),
        (prefix + mlp + r"\.net\.0\.proj\.bias", COLUMN_BIAS),
        (prefix + mlp + r"\.net\.2\.weight", row),
        (prefix + mlp + r"\.net\.2\.bias", row_bias),
    )


def _text_encoder_specs(split_attention: bool) -> tuple[Layout, Layout, Layout]:
    """Column, column-bias and row specs for a text encoder's attention: Megatron when `tp` divides its
    heads, else replicated (the MLP is split either way)."""
    return (COLUMN, COLUMN_BIAS, ROW) if split_attention else (REPLICATED, REPLICATED, REPLICATED)


def t5_encoder_rules(split_attention: bool = True) -> RuleTable:
    """T5EncoderModel (CogVideoX's T5-XXL v1.1, HunyuanVideo-1.5's ByT5): Megatron q/k/v/o and MLP
    (wi or gated wi_0/wi_1 in, wo out); the relative position bias table is split on its heads axis so
    the bias it produces lines up with the split scores. Replicated: the RMS norms and the token
    embedding (a vocab-split lookup would add an all-reduce per call for a few hundred MiB saved)."""
    column, _, row = _text_encoder_specs(split_attention)
    layer = r"encoder\.block\.\d+\.layer\."
    return RuleTable(
        f"t5-encoder/{'megatron' if split_attention else 'megatron-mlp'}",
        (
            (layer + r"0\.SelfAttention\.[qkv]\.weight", column),
            (layer + r"0\.SelfAttention\.o\.weight", row),
            (
                layer + r"0\.SelfAttention\.relative_attention_bias\.weight",
                (None, TP) if split_attention else REPLICATED,
            ),
            (layer + r"1\.DenseReluDense\.wi(_[01])?\.weight", COLUMN),
            (layer + r"1\.DenseReluDense\.wo\.weight", ROW),
            (layer + r"[01]\.layer_norm\.weight", REPLICATED),
            (r"(shared|encoder\.embed_tokens)\.weight", REPLICATED),  # tied: one array on the device
            (r"encoder\.final_layer_norm\.weight", REPLICATED),
        ),
    )


def qwen25vl_text_rules(split_attention: bool = True) -> RuleTable:
    """Qwen2_5_VLTextModel (HunyuanVideo-1.5's prompt encoder): Megatron q/k/v (with biases), o_proj
    and the gated MLP. Qwen2.5-VL-7B has 28 query and 4 key/value heads, so `tp` = 8 cannot split its
    attention: then attention is replicated and only the MLP is split. Replicated: RMS norms and the
    token embedding."""
    column, column_bias, row = _text_encoder_specs(split_attention)
    layer = r"layers\.\d+\."
    return RuleTable(
        f"qwen2.5-vl-text/{'megatron' if split_attention else 'megatron-mlp'}",
        (
            (layer + r"self_attn\.[qkv]_proj\.weight", column),
            (layer + r"self_attn\.[qkv]_proj\.bias", column_bias),
            (layer + r"self_attn\.o_proj\.weight", row),
            (layer + r"mlp\.(gate|up)_proj\.weight", COLUMN),
            (layer + r"mlp\.down_proj\.weight", ROW),
            (layer + r"(input|post_attention)_layernorm\.weight", REPLICATED),
            (r"embed_tokens\.weight", REPLICATED),
            (r"norm\.weight", REPLICATED),
        ),
    )


def gemma3_text_rules(split_attention: bool = True) -> RuleTable:
    """Gemma3TextModel (LTX-2's prompt encoder, Gemma 3 12B: 16 query and 8 key/value heads of 256): Megatron
    q/k/v (no biases), o_proj and the gated MLP. Replicated: the per-head q/k RMS norms (one head's width),
    the four norms around attention and MLP, the token embedding and the final norm."""
    column, _, row = _text_encoder_specs(split_attention)
    layer = r"layers\.\d+\."
    return RuleTable(
        f"gemma3-text/{'megatron' if split_attention else 'megatron-mlp'}",
        (
            (layer + r"self_attn\.[qkv]_proj\.weight", column),
            (layer + r"self_attn\.o_proj\.weight", row),
            (layer + r"self_attn\.[qk]_norm\.weight", REPLICATED),
            (layer + r"mlp\.(gate|up)_proj\.weight", COLUMN),
            (layer + r"mlp\.down_proj\.weight", ROW),
            (layer + r"(input|post_attention|pre_feedforward|post_feedforward)_layernorm\.weight", REPLICATED),
            (r"embed_tokens\.weight", REPLICATED),
            (r"norm\.weight", REPLICATED),
        ),
    )


def text_encoder_rules(config, tp: int) -> RuleTable:
    """The rule table for a transformers text encoder config on a mesh with `tp` devices on its `tp`
    axis: attention is split only where `tp` divides every head count."""
    if config.model_type in ("t5", "umt5"):  # UMT5 (Wan): T5's names, a bias table in every layer
        return t5_encoder_rules(split_attention=config.num_heads % tp == 0)
    # Gemma 4's text model (LTX-2.5) names its weights as Gemma 3's.
    decoders = {
        "qwen2_5_vl_text": qwen25vl_text_rules,
        "gemma3_text": gemma3_text_rules,
        "gemma4_unified_text": gemma3_text_rules,
    }
    if config.model_type in decoders:
        return decoders[config.model_type](split_attention=all(count % tp == 0 for count in head_counts(config)))
    raise ValueError(f"no sharding rules for a {config.model_type!r} text encoder")


def head_counts(config) -> set[int]:
    """Every layer's query and key/value head counts, read per layer: Gemma 4 sets its full-attention layers'
    own (`num_global_key_value_heads`), and then refuses the model-wide attribute."""
    layers = [config.per_layer_config[index] for index in range(config.num_hidden_layers)]
    return {count for layer in layers for count in (layer.num_attention_heads, layer.num_key_value_heads)}


# VAEs and other small modules: convolution weights are small next to their activations.
REPLICATED_TABLE = RuleTable("replicated", ((r".*", REPLICATED),))
