"""The dp/sp/tp device mesh, per-model weight rule tables, and placing weights and activations on it.

Mesh axes, outermost first: `dp` (the two classifier-free-guidance branches, or more batch), `sp`
(the query sequence inside attention, and the token axis between blocks), `tp` (attention heads and
MLP columns). `tp` is innermost so its traffic stays between neighbouring chips.

A rule table is an ordered list of (regex, PartitionSpec) over parameter names; the first match wins.
`P()` marks a weight as deliberately replicated. Every parameter must match a rule and every rule must
match a parameter, so a renamed layer cannot silently fall back to replication.

Weights use the Megatron layout: column-parallel inputs (q/k/v, MLP in: torch's (out, in) weight split
on `out`) and row-parallel outputs (attention out, MLP out: split on `in`), which costs one all-reduce
after attention and one after the MLP per block, plus a small one per AdaLN modulation (MODULATION).
`--tp_mode replicated_out` keeps the row-parallel
outputs replicated instead: more memory, and under XLA's partitioner no fewer collectives
(benchmarks/collectives.py measures both).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.interface import AXES, TP
from runtime.mesh import MeshShape

TP_MODES = ("megatron", "replicated_out")
P = PartitionSpec
REPLICATED = P()
COLUMN = P(TP, None)  # torch Linear weight (out, in): output features split
COLUMN_BIAS = P(TP)
ROW = P(None, TP)  # input features split; the partial sums are all-reduced
# AdaLN modulation linears (timestep embedding -> 6 x width of shifts, scales, gates per block) are a
# large share of the weights (HunyuanVideo-1.5: 2.7 B of 8.3 B parameters) but act on one vector per
# sample: split on their input, each costs one all-reduce of (batch, 6 x width), a few hundred KiB.
MODULATION = ROW


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The dp/sp/tp mesh over `devices` (default: all), host by host, so the innermost axis (tp) stays
    within one host wherever it divides a host's devices (runtime.mesh.default_mesh)."""
    devices = sorted(
        jax.devices() if devices is None else devices, key=lambda device: (device.process_index, device.id)
    )
    return Mesh(np.array(devices[: shape.size]).reshape(shape.dp, shape.sp, shape.tp), AXES)


def fit_spec(spec: PartitionSpec | tuple, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """`spec` (a PartitionSpec or a tuple of axis names) with each mesh axis dropped from a dimension it
    does not divide; that dimension is then replicated."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[name] for name in names)
        fitted.append(axes if names and dim % size == 0 else None)
    return P(*fitted)


# torch dtypes as JAX holds them: JAX runs without x64, as torchax does, so 64-bit types narrow.
JAX_DTYPES = {
    torch.float32: jax.numpy.float32,
    torch.float64: jax.numpy.float32,
    torch.bfloat16: jax.numpy.bfloat16,
    torch.float16: jax.numpy.float16,
    torch.int64: jax.numpy.int32,
    torch.int32: jax.numpy.int32,
    torch.bool: jax.numpy.bool_,
}


def abstract(shape: Sequence[int], dtype, layout: PartitionSpec | tuple = (), *, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """What an array placed on `mesh` as `layout` looks like to the compiler: shape, dtype (torch or JAX)
    and sharding, no data. The planner and the collective counts compile over these."""
    shape = tuple(shape)
    return jax.ShapeDtypeStruct(
        shape, JAX_DTYPES.get(dtype, dtype), sharding=NamedSharding(mesh, fit_spec(layout, shape, mesh))
    )


# Rule tables ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleTable:
    name: str
    rules: tuple[tuple[str, PartitionSpec], ...]
    optional: frozenset[int] = frozenset()  # indices of rules only some variants use (may match nothing)

    def nested(self, prefix: str) -> RuleTable:
        """The same rules for the model mounted as submodule `prefix` (e.g. "transformer.")."""
        rules = tuple((re.escape(prefix) + pattern, spec) for pattern, spec in self.rules)
        return RuleTable(self.name, rules, self.optional)

    def spec_for(self, param_name: str) -> tuple[int, PartitionSpec] | None:
        for index, (pattern, spec) in enumerate(self.rules):
            if re.fullmatch(pattern, param_name):
                return index, spec
        return None

    def assign(self, names: Sequence[str]) -> dict[str, PartitionSpec]:
        """Each parameter's spec; raises ValueError on an unmatched parameter or an unused rule."""
        specs, used = {}, set()
        unmatched = []
        for name in names:
            found = self.spec_for(name)
            if found is None:
                unmatched.append(name)
                continue
            used.add(found[0])
            specs[name] = found[1]
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


def cogvideox_transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """CogVideoXTransformer3DModel (1.0 and 1.5). AdaLN modulation linears are split on their input
    (MODULATION). Norms, embeddings and the output projection are small next to the blocks and stay
    replicated, so nothing outside the blocks needs a collective."""
    block = r"transformer_blocks\.\d+\."
    rules = megatron_rules(block, r"attn1\.to_[qkv]", r"attn1\.to_out\.0", "ff", tp_mode) + (
        (block + r"attn1\.norm_[qk]\.(weight|bias)", REPLICATED),  # per-head-dim LayerNorm
        (block + r"norm[12]\.linear\.weight", MODULATION),
        (block + r"norm[12]\.(linear|norm)\.(weight|bias)", REPLICATED),  # AdaLN bias, LayerNorm
        (r"patch_embed\..*", REPLICATED),
        (r"time_embedding\..*", REPLICATED),
        (r"(norm_final|norm_out\.(linear|norm))\.(weight|bias)", REPLICATED),
        (r"proj_out\.(weight|bias)", REPLICATED),
        (r"ofs_embedding\..*", REPLICATED),  # CogVideoX 1.5 I2V's ofs embedding: optional, the last rule
    )
    return RuleTable(f"cogvideox-transformer/{tp_mode}", rules, frozenset({len(rules) - 1}))


def hunyuanvideo15_transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """HunyuanVideo15Transformer3DModel: double-stream blocks (image stream `to_*`/`ff`, text stream
    `add_*`/`to_add_out`/`ff_context`) and the token refiner's blocks get the Megatron layout.
    The blocks' AdaLN modulation linears are split on their input (MODULATION). Replicated: their
    biases, q/k RMS norms over the head dim, the refiner's small modulations, the ByT5 mapper,
    embedders and the final layers."""
    block = r"transformer_blocks\.\d+\."
    refiner = r"context_embedder\.token_refiner\.refiner_blocks\.\d+\."
    return RuleTable(
        f"hunyuanvideo15-transformer/{tp_mode}",
        megatron_rules(
            block, r"attn\.(to_[qkv]|add_[qkv]_proj)", r"attn\.(to_out\.0|to_add_out)", "(ff|ff_context)", tp_mode
        )
        + megatron_rules(refiner, r"attn\.to_[qkv]", r"attn\.to_out\.0", "ff", tp_mode)
        + (
            (block + r"attn\.norm_(added_)?[qk]\.weight", REPLICATED),
            (block + r"norm1(_context)?\.linear\.weight", MODULATION),
            (block + r"norm1(_context)?\.linear\.bias", REPLICATED),
            (refiner + r"(norm1|norm2|norm_out\.linear)\.(weight|bias)", REPLICATED),
            (r"context_embedder\.(time_text_embed|proj_in)\..*", REPLICATED),
            (r"context_embedder_2\..*", REPLICATED),  # ByT5 mapper
            (r"(x_embedder|image_embedder|time_embed)\..*", REPLICATED),
            (r"cond_type_embed\.weight", REPLICATED),
            (r"(norm_out\.linear|proj_out)\.(weight|bias)", REPLICATED),
        ),
    )


def wan_transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """WanTransformer3DModel (Wan 2.1 and 2.2, text- and image-to-video): self- and cross-attention and the
    MLP get the Megatron layout; q/k RMS norms span all heads, so their weights are split like q/k's columns.

    Modulation: one `condition_embedder.time_proj` (width -> 6 x width, 14B: 157 M parameters) feeds
    every block, which only adds its own `scale_shift_table` (6 x width). time_proj is split on its
    input (MODULATION): one all-reduce of (batch, 6 x width) per step, not per block, and the tables
    stay replicated (6 x width each, fp32) so no block needs a collective for its modulation.
    Image-to-video (Wan 2.1 I2V, optional rules): the cross-attention's image keys and values are split
    like its text ones, their RMS norm like norm_k; the image embedder (CLIP width -> width, once per
    run's tokens) stays replicated. Replicated: the patch, time and text embedders and the output layers."""
    block = r"blocks\.\d+\."
    image = (
        (block + r"attn2\.add_[kv]_proj\.weight", COLUMN),
        (block + r"attn2\.add_[kv]_proj\.bias", COLUMN_BIAS),
        (block + r"attn2\.norm_added_k\.weight", COLUMN_BIAS),
        (r"condition_embedder\.image_embedder\..*", REPLICATED),
    )
    rules = (
        megatron_rules(block, r"attn[12]\.to_[qkv]", r"attn[12]\.to_out\.0", "ffn", tp_mode)
        + (
            (block + r"attn[12]\.norm_[qk]\.weight", COLUMN_BIAS),
            (block + r"scale_shift_table", REPLICATED),
            (block + r"norm2\.(weight|bias)", REPLICATED),  # cross-attention LayerNorm
            (r"condition_embedder\.time_proj\.weight", MODULATION),
            (r"condition_embedder\.time_proj\.bias", REPLICATED),
            (r"condition_embedder\.(time_embedder|text_embedder)\..*", REPLICATED),
            (r"patch_embedding\.(weight|bias)", REPLICATED),
            (r"(scale_shift_table|proj_out\.(weight|bias))", REPLICATED),
        )
        + image
    )
    optional = frozenset(range(len(rules) - len(image), len(rules)))
    return RuleTable(f"wan-transformer/{tp_mode}", rules, optional)


def _text_encoder_specs(split_attention: bool) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
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
                P(None, TP) if split_attention else REPLICATED,
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


def text_encoder_rules(config, tp: int) -> RuleTable:
    """The rule table for a transformers text encoder config on a mesh with `tp` devices on its `tp`
    axis: attention is split only where `tp` divides every head count."""
    if config.model_type in ("t5", "umt5"):  # UMT5 (Wan): T5's names, a bias table in every layer
        return t5_encoder_rules(split_attention=config.num_heads % tp == 0)
    if config.model_type == "qwen2_5_vl_text":
        heads = (config.num_attention_heads, config.num_key_value_heads)
        return qwen25vl_text_rules(split_attention=all(count % tp == 0 for count in heads))
    raise ValueError(f"no sharding rules for a {config.model_type!r} text encoder")


# VAEs and other small modules: convolution weights are small next to their activations.
REPLICATED_TABLE = RuleTable("replicated", ((r".*", REPLICATED),))


# Placement -----------------------------------------------------------------------------------------


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor without copying (bf16 through its bits)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(jax.numpy.bfloat16)
    return tensor.numpy()


def _place_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Each device receives only its own slice, so no full extra copy is made on the way."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def place_module(module: torch.nn.Module, table: RuleTable, mesh: Mesh, env) -> dict[str, object]:
    """Replace the module's CPU weights, one at a time, by torchax tensors sharded by `table` (weights
    already placed that way are kept as they are).

    Each CPU tensor is released as soon as its device copy exists, so host memory stays near one copy
    of the weights. Tied weights (one tensor under several names, e.g. T5's `shared` and
    `encoder.embed_tokens`) stay one device array. Buffers are replicated. Returns the rule table's
    name, counts and per-device bytes (the caller logs and records them).
    """
    from torchax.tensor import Tensor

    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    specs = table.assign(names)
    stats = {"rule_table": table.name, "sharded": 0, "replicated": 0, "buffers": 0, "bytes_per_device": 0}
    placed: dict[int, tuple] = {}  # id of a CPU tensor -> (a weak reference to it, its device copy)
    for kind, store in (("param", "_parameters"), ("buffer", "_buffers")):
        for owner_name, owner in module.named_modules():
            for leaf, value in list(getattr(owner, store).items()):
                if value is None or not isinstance(value, torch.Tensor):
                    continue
                known, device_copy = placed.get(id(value), (None, None))
                if known is not None and known() is value:  # the weak reference: ids of freed tensors recur
                    getattr(owner, store)[leaf] = device_copy
                    continue
                full_name = f"{owner_name}.{leaf}" if owner_name else leaf
                spec = specs.get(full_name, REPLICATED) if kind == "param" else REPLICATED
                spec = fit_spec(spec, value.shape, mesh)
                target = NamedSharding(mesh, spec)
                if isinstance(value, Tensor) and value.jax().sharding.is_equivalent_to(target, value.ndim):
                    array = value.jax()  # placed before, as wanted (stage 3 reusing one VAE): kept, no host trip
                else:
                    array = _place_array(_host_array(value), target)
                getattr(owner, store)[leaf] = device_copy = Tensor(array, env)
                placed[id(value)] = (weakref.ref(value), device_copy)
                del value
                shard_bytes = array.addressable_shards[0].data.nbytes
                stats["bytes_per_device"] += shard_bytes
                if kind == "buffer":
                    stats["buffers"] += 1
                elif any(axis is not None for axis in spec):
                    stats["sharded"] += 1
                else:
                    stats["replicated"] += 1
    return stats


def place(tree, mesh: Mesh, spec: PartitionSpec, env):
    """torchax tensors for the CPU tensors in `tree`, each laid out as `spec` (axes it cannot divide dropped)."""
    from torchax.tensor import Tensor

    def one(value):
        if not isinstance(value, torch.Tensor):
            return value
        sharding = NamedSharding(mesh, fit_spec(spec, value.shape, mesh))
        return Tensor(_place_array(_host_array(value.contiguous()), sharding), env)

    return torch.utils._pytree.tree_map(one, tree)


def constraint_spec(spec: PartitionSpec | tuple, shape: Sequence[int], mesh: Mesh, uneven: bool) -> PartitionSpec:
    """`spec` for a constraint inside a compiled program: `fit_spec`, or with `uneven` each axis kept where the
    dimension is at least the axis size, divided or not: XLA's partitioner then pads the last shards (jit's
    arguments and results must divide; a constraint inside may not)."""
    if not uneven:
        return fit_spec(spec, shape, mesh)
    dims = zip(shape, tuple(spec), strict=False)  # a spec may name fewer dimensions than the tensor has
    return P(*(axes if axes is None or dim >= mesh.shape[axes] else None for dim, axes in dims))


def constrain(tensor: torch.Tensor, mesh: Mesh, spec: PartitionSpec, uneven: bool = False) -> torch.Tensor:
    """A sharding constraint on a traced torchax tensor (`constraint_spec`)."""
    from torchax.interop import call_jax

    sharding = NamedSharding(mesh, constraint_spec(spec, tensor.shape, mesh, uneven))
    return call_jax(jax.lax.with_sharding_constraint, tensor, sharding)
