"""Attention on NVIDIA GPUs: JAX's cuDNN fused (flash) attention with padding passed as sequence lengths.

`jax.nn.dot_product_attention` takes padding as per-row lengths, which is exact when each row's valid
tokens come first: true for every family here (CogVideoX and Wan have no masks; HunyuanVideo-1.5 puts
valid text tokens first by its reorder, and its refiner's tokenizer pads on the right). Other masks are
refused. splash_attention.make_sdpa registers it as the `cudnn` backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_video.program_checks import check

NOT_A_PREFIX = (
    "fused (cuDNN) attention takes padding as lengths: each row's valid keys (and queries) must come "
    "first; this mask is not such a prefix (use --attention xla)"
)


def _lengths(valid):
    """Per-row lengths of a boolean (B, S) validity that must be a prefix (True..True False..False)."""
    lengths = valid.sum(axis=-1).astype(jnp.int32)
    not_prefix = (valid != (jnp.arange(valid.shape[-1])[None, :] < lengths[:, None])).any()
    check(not_prefix, NOT_A_PREFIX)
    return lengths


def fused_attention(query, key, value, key_valid=None, query_valid=None, *, scale=None, implementation="cudnn"):
    """`jax.nn.dot_product_attention` (cuDNN flash attention on NVIDIA GPUs; implementation None: XLA
    anywhere) on (B, H, S, D) tensors, with padding masks passed as sequence lengths, so no S x S mask
    exists. Rows with no valid key, and padded queries, give zeros, as PyTorch's SDPA and the other
    backends here do."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (query, key, value))  # (B, S, H, D), JAX's layout
    kv_lengths = None if key_valid is None else _lengths(key_valid)
    q_lengths = None if query_valid is None else _lengths(query_valid)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
    ).transpose(0, 2, 1, 3)
    rows = jnp.ones(out.shape[:1] + out.shape[2:3], dtype=bool)  # (B, Sq)
    if query_valid is not None:
        rows = rows & query_valid
    if key_valid is not None:
        rows = rows & key_valid.any(axis=-1, keepdims=True)
    return jnp.where(rows[:, None, :, None], out, jnp.zeros((), out.dtype))
