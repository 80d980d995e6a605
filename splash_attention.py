"""Attention for torchax: the Pallas Splash Attention kernel with exact key masking, registered as
`torch.nn.functional.scaled_dot_product_attention` inside the torchax environment.

Exactness. Splash needs sequence lengths that are multiples of its tiles, so queries and keys are
padded. Padded (and user-masked) keys are excluded with the kernel's segment ids: every query gets
segment 0, valid keys segment 0 and excluded keys segment 1, so a query's softmax runs over exactly
the valid keys. Zeroing padded K/V instead (the reference notes' approach) leaves each padded key at
score 0 in the denominator: 28% relative error at 40% padding (../shared/PITFALLS.md). Segment ids
have no such term; tests/test_splash_attention.py holds them to 1e-5 of a float64 reference.

On TPU the kernel is compiled by Mosaic; elsewhere it runs in Pallas interpret mode (slow, for tests).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

LANE = 128  # TPU lane width: block sizes are multiples of it
BACKENDS = ("auto", "splash", "xla")


@dataclass(frozen=True)
class SplashConfig:
    """Tile sizes (upper bounds: a short sequence uses one tile of its own padded length)."""

    block_q: int = 3328
    block_kv: int = 2816
    block_kv_compute: int = 256
    interpret: bool = False

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "block_kv_compute"):
            value = getattr(self, name)
            if value <= 0 or value % LANE:
                raise ValueError(f"{name} {value} must be a positive multiple of {LANE}")
        if self.block_kv % self.block_kv_compute:
            raise ValueError(f"block_kv_compute {self.block_kv_compute} must divide block_kv {self.block_kv}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tile_sizes(config: SplashConfig, q_len: int, kv_len: int) -> splash_kernel.BlockSizes:
    """Clamp the configured tiles to the sequence, keeping the kernel's divisibility rules."""
    block_q = min(config.block_q, _round_up(q_len, LANE))
    block_kv = min(config.block_kv, _round_up(kv_len, LANE))
    compute = min(config.block_kv_compute, block_kv)
    while block_kv % compute:
        compute -= LANE
    return splash_kernel.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=compute)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, q_len: int, kv_len: int, blocks: splash_kernel.BlockSizes, interpret: bool):
    """The kernel for one shape, built once. Its mask tables must be concrete arrays, not tracers of
    whichever jit happened to build it first, or the cached kernel would leak them into the next trace."""
    mask = splash_mask.MultiHeadMask([splash_mask.FullMask((q_len, kv_len))] * heads)
    with jax.ensure_compile_time_eval():
        return splash_kernel.make_splash_mha(
            mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def splash_attention(query, key, value, key_valid=None, *, scale: float | None = None, config: SplashConfig):
    """Exact masked attention. query (B, H, Sq, D), key/value (B, H, Skv, D), key_valid (B, Skv) bool or None.

    A batch row with no valid key at all returns zeros (PyTorch's SDPA does the same for such rows).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    blocks = tile_sizes(config, q_len, kv_len)
    q_pad, kv_pad = _round_up(q_len, blocks.block_q), _round_up(kv_len, blocks.block_kv)
    kernel = _kernel(heads, q_pad, kv_pad, blocks, config.interpret)

    if key_valid is None:
        key_valid = jnp.ones((batch, kv_len), dtype=bool)
    key_valid = jnp.broadcast_to(key_valid.astype(bool), (batch, kv_len))
    kv_segments = jnp.pad(jnp.where(key_valid, 0, 1), ((0, 0), (0, kv_pad - kv_len)), constant_values=1)
    q_segments = jnp.zeros((batch, q_pad), dtype=jnp.int32)

    # Splash does not scale scores itself; scaling q first is the same product.
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    query = query * jnp.asarray(scale, dtype=query.dtype)

    def pad(tensor, length):
        return jnp.pad(tensor, ((0, 0), (0, 0), (0, length - tensor.shape[2]), (0, 0)))

    def one_row(q, k, v, q_seg, kv_seg):
        return kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(q=q_seg, kv=kv_seg.astype(jnp.int32)))

    out = jax.vmap(one_row)(pad(query, q_pad), pad(key, kv_pad), pad(value, kv_pad), q_segments, kv_segments)
    out = out[:, :, :q_len].astype(query.dtype)
    has_key = key_valid.any(axis=1)[:, None, None, None]
    return jnp.where(has_key, out, jnp.zeros_like(out))


def key_valid_from_mask(attn_mask, batch: int, kv_len: int):
    """A per-key validity vector (B, Skv) from a boolean mask broadcastable as (B, 1, 1, Skv)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != jnp.bool_:
        raise ValueError(f"splash attention takes boolean key masks; got {attn_mask.dtype}")
    if attn_mask.ndim == 2:
        return jnp.broadcast_to(attn_mask, (batch, kv_len))
    if attn_mask.ndim == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
        return jnp.broadcast_to(attn_mask[:, 0, 0, :], (batch, kv_len))
    raise ValueError(
        f"splash attention takes key-padding masks shaped (B, Skv) or (B, 1, 1, Skv); got {tuple(attn_mask.shape)}"
    )


def make_sdpa(config: SplashConfig):
    """A torch-level `scaled_dot_product_attention` (diffusers' keyword names) that calls Splash."""
    from torchax.interop import call_jax

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if dropout_p or is_causal or enable_gqa:
            raise ValueError("splash attention supports neither dropout, is_causal nor enable_gqa")

        def jax_attention(q, k, v, mask):
            key_valid = key_valid_from_mask(mask, q.shape[0], k.shape[2])
            return splash_attention(q, k, v, key_valid, scale=scale, config=config)

        return call_jax(jax_attention, query, key, value, attn_mask)

    return scaled_dot_product_attention


def resolve_backend(requested: str) -> str:
    """`auto` is Splash on TPU and torchax's XLA lowering elsewhere."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {BACKENDS}")
    if requested == "auto":
        return "splash" if jax.devices()[0].platform == "tpu" else "xla"
    return requested


@contextlib.contextmanager
def attention_backend(env, backend: str, config: SplashConfig):
    """Within the block, SDPA in the torchax environment `env` runs `backend` ("splash" or "xla").

    torchax's public `override_op_definition` has no undo, so the previous entry of the private op
    table is put back on exit; that keeps tests and repeated in-process runs independent.
    """
    op = torch.nn.functional.scaled_dot_product_attention
    previous = env._ops.get(op)
    if backend == "splash":
        env.override_op_definition(op, make_sdpa(config))
    try:
        yield
    finally:
        if previous is None:
            env._ops.pop(op, None)
        else:
            env._ops[op] = previous
