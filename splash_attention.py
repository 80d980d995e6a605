"""Attention for torchax: the Pallas Splash Attention kernel with exact key masking, which the SDPA override
(tpu_video/runtime/sdpa.py) calls for `torch.nn.functional.scaled_dot_product_attention` under torchax.

Exactness. Splash needs sequence lengths that are multiples of its tiles, so queries and keys are
padded. Padded (and user-masked) keys are excluded with the kernel's segment ids: every query gets
segment 0, valid keys segment 0 and excluded keys segment 1, so a query's softmax runs over exactly
the valid keys. Zeroing padded K/V instead (the reference notes' approach) leaves each padded key at
score 0 in the denominator: 28% relative error at 40% padding (benchmarks/attention_exactness.py). Segment ids
have no such term; tests/test_splash_attention.py holds them to 1e-5 of a float64 reference.

With a mesh the kernel runs under shard_map: batch on `dp`, heads on `tp`, and with `sp` the scheme the
run's attention plan chose (Ulysses, ring or gather: tpu_video/attention/sequence_parallel.py). On TPU the kernel
is compiled by Mosaic; elsewhere it runs in Pallas interpret mode (slow, for tests). Its tiles and options
are attention.plan.SplashConfig; the SDPA override that calls it is tpu_video/runtime/sdpa.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import DP, SP, TP
from tpu_video.attention.masks import pad_sequence, round_up, rows_with_a_key
from tpu_video.attention.plan import LANE, SplashConfig
from tpu_video.attention.sequence_parallel import mesh_axes, ring, ulysses


def tile_sizes(config: SplashConfig, q_len: int, kv_len: int) -> splash_kernel.BlockSizes:
    """Clamp the configured tiles to the sequence, keeping the kernel's divisibility rules."""
    block_q = min(config.block_q, round_up(q_len, LANE))
    block_kv = min(config.block_kv, round_up(kv_len, LANE))
    compute = min(config.block_kv_compute, block_kv)
    while block_kv % compute:
        compute -= LANE
    return splash_kernel.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=compute)


@functools.lru_cache(maxsize=64)
def _kernel(
    heads: int,
    q_len: int,
    kv_len: int,
    blocks: splash_kernel.BlockSizes,
    interpret: bool,
    local_window: int | None,
    head_shards: int,
    q_seq_shards: int,
    save_residuals: bool = False,
):
    """The kernel for one (global) shape, built once (`save_residuals`: it also returns the log-sum-exp,
    which ring attention merges by). Its mask tables must be concrete arrays, not
    tracers of whichever jit happened to build it first, or the cached kernel would leak them into the
    next trace."""
    shape = (q_len, kv_len)
    if local_window is None:
        head_mask = splash_mask.FullMask(shape)
    else:
        head_mask = splash_mask.LocalMask(shape, (local_window, local_window), offset=0, shard_count=q_seq_shards)
    with jax.ensure_compile_time_eval():
        return splash_kernel.make_splash_mha(
            splash_mask.MultiHeadMask([head_mask] * heads),
            block_sizes=blocks,
            head_shards=head_shards,
            q_seq_shards=q_seq_shards,
            save_residuals=save_residuals,
            interpret=interpret,
        )


def _smooth_keys(key, key_valid):
    """Keys minus the mean of the valid keys (per batch row and head); masked keys set to zero."""
    valid = key_valid[:, None, :, None]
    count = jnp.maximum(key_valid.sum(axis=1), 1)[:, None, None, None]
    mean = jnp.where(valid, key.astype(jnp.float32), 0.0).sum(axis=2, keepdims=True) / count
    return jnp.where(valid, key - mean.astype(key.dtype), jnp.zeros_like(key))


def splash_attention(
    query,
    key,
    value,
    key_valid=None,
    *,
    query_valid=None,
    scale: float | None = None,
    config: SplashConfig,
    mesh: Mesh | None = None,
    scheme: str | None = None,
):
    """Exact masked attention. query (B, H, Sq, D), key/value (B, H, Skv, D), key_valid (B, Skv) bool or None.

    With a mesh, runs under shard_map: batch on `dp`, heads on `tp`; with `sp`, `scheme` (this call's, from
    the plan: sequence_parallel.call_scheme): Ulysses (queries, keys and values split along the sequence,
    exchanged for a head split inside), ring (key/value chunks passed round `sp`), or gather (the query
    sequence on `sp` with keys and values whole on every device). Query rows that are invalid
    (`query_valid` False) or have no valid key at all return zeros, as PyTorch's SDPA does for fully
    masked rows.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    window = config.local_window
    if window is not None and q_len != kv_len:
        raise ValueError(f"a local window needs self-attention; got {q_len} queries and {kv_len} keys")
    batch_axis, head_axis, q_shards = mesh_axes(mesh, batch, heads)
    head_shards = mesh.shape[TP] if head_axis else 1
    if scheme == "ulysses":
        # Each device attends over the whole (padded) sequence for heads / (tp * sp) heads.
        sp = mesh.shape[SP]
        blocks = tile_sizes(config, q_len, kv_len)
        q_pad = round_up(q_len, math.lcm(blocks.block_q, sp))
        kv_pad = round_up(kv_len, math.lcm(blocks.block_kv, sp))
        kernel = _kernel(heads // head_shards // sp, q_pad, kv_pad, blocks, config.interpret, window, 1, 1)
        kernel_layout = P(None, None)
    elif scheme == "ring":
        # Each device attends its query chunk to one key chunk at a time (sp chunks of each).
        blocks = tile_sizes(config, -(-q_len // q_shards), -(-kv_len // q_shards))
        q_pad, kv_pad = round_up(q_len, blocks.block_q * q_shards), round_up(kv_len, blocks.block_kv * q_shards)
        local_heads = heads // head_shards
        kernel = _kernel(local_heads, q_pad // q_shards, kv_pad // q_shards, blocks, config.interpret, None, 1, 1, True)
        kernel_layout = P(None, None)
    else:
        blocks = tile_sizes(config, -(-q_len // q_shards), kv_len)
        q_pad, kv_pad = round_up(q_len, blocks.block_q * q_shards), round_up(kv_len, blocks.block_kv)
        if window is None:
            # A full mask is the same on every shard, so each device gets a kernel for its local shape.
            # (Building one global kernel with q_seq_shards > 1 fails for a mask without partial blocks in
            # jax 0.10.2: process_mask concatenates an empty mask_next list.)
            kernel = _kernel(heads // head_shards, q_pad // q_shards, kv_pad, blocks, config.interpret, None, 1, 1)
            kernel_layout = P(None, None)
        else:
            kernel = _kernel(heads, q_pad, kv_pad, blocks, config.interpret, window, head_shards, q_shards)
            kernel_layout = P(head_axis, SP)

    if key_valid is None:
        key_valid = jnp.ones((batch, kv_len), dtype=bool)
    key_valid = jnp.broadcast_to(key_valid.astype(bool), (batch, kv_len))
    if config.k_smoothing:
        key = _smooth_keys(key, key_valid)
    padded_valid = jnp.pad(key_valid, ((0, 0), (0, kv_pad - kv_len)))
    kv_segments = jnp.where(padded_valid, 0, 1).astype(jnp.int32)
    q_segments = jnp.zeros((batch, q_pad), dtype=jnp.int32)

    # Splash does not scale scores itself; scaling q first is the same product.
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    query = query * jnp.asarray(scale, dtype=query.dtype)

    def attend(kernel, q, k, v, q_seg, kv_seg):
        def one_row(q, k, v, q_seg, kv_seg):
            return kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(q=q_seg, kv=kv_seg))

        return jax.vmap(one_row)(q, k, v, q_seg, kv_seg)

    local_batch = batch // mesh.shape[DP] if batch_axis else batch
    work = 4 * local_batch * (heads // head_shards) * (q_pad // q_shards) * kv_pad * head_dim  # all schemes
    _record(KernelCall(q_len, kv_len, q_pad, kv_pad, work))
    q, k, v = pad_sequence(query, q_pad), pad_sequence(key, kv_pad), pad_sequence(value, kv_pad)
    if mesh is not None and mesh.size > 1:
        kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, kernel_layout))
    if scheme == "ulysses":
        whole = P(batch_axis, None)
        local = ulysses(
            mesh,
            batch_axis,
            head_axis,
            lambda q, k, v, *rest: attend(rest[0], q, k, v, *rest[1:]),
            (kernel_spec, whole, whole),
        )
        out = local(q, k, v, kernel, q_segments, kv_segments)
    elif scheme == "ring":

        def chunk(q, k, v, chunk_valid, kernel, q_seg):
            out, (lse,) = attend(kernel, q, k, v, q_seg, jnp.where(chunk_valid, 0, 1).astype(jnp.int32))
            # A chunk without a valid key for a row contributes nothing (the kernel's value there is not a softmax).
            seen = chunk_valid.any(axis=1)[:, None, None]
            return jnp.where(seen[..., None], out, 0), jnp.where(seen, lse, -jnp.inf)

        local = ring(mesh, batch_axis, head_axis, chunk, (kernel_spec, P(batch_axis, SP)))
        out = local(q, k, v, padded_valid, kernel, q_segments)
    else:
        if mesh is not None and mesh.size > 1:
            q_spec = P(batch_axis, head_axis, SP, None)
            kv_spec = P(batch_axis, head_axis, None, None)
            attend = jax.shard_map(
                attend,
                mesh=mesh,
                in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(batch_axis, SP), P(batch_axis, None)),
                out_specs=q_spec,
                check_vma=False,
            )
        out = attend(kernel, q, k, v, q_segments, kv_segments)
    out = out[:, :, :q_len].astype(query.dtype)
    keep = rows_with_a_key(key_valid, q_len, window)[:, None, :, None]
    if query_valid is not None:
        keep = keep & jnp.broadcast_to(query_valid, (batch, q_len))[:, None, :, None]
    return jnp.where(keep, out, jnp.zeros_like(out))


@dataclass(frozen=True)
class KernelCall:
    """One Splash call as traced: global lengths, the padded lengths the kernel computes, and the work
    one device does (attention FLOPs are invisible to XLA's cost analysis of the custom call)."""

    q_len: int
    kv_len: int
    q_padded: int
    kv_padded: int
    flops_per_device: int  # 4 * batch * heads * q * kv * head_dim over this device's share, padding included


_RECORDERS: list[list[KernelCall]] = []


@contextlib.contextmanager
def record_kernel_calls():
    """Collect a KernelCall for every Splash call traced inside the block (what --plan reports)."""
    calls: list[KernelCall] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def _record(call: KernelCall) -> None:
    for calls in _RECORDERS:
        calls.append(call)
