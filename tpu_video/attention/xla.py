"""Softmax attention as plain XLA ops: the backend off TPU and GPU, for any mask, and its exact
sequence-parallel forms (tpu_video/attention/sequence_parallel.py) for boolean masks."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding import SP
from tpu_video.attention.masks import masks_from_attn_mask, pad_sequence, padded_validity, round_up
from tpu_video.attention.sequence_parallel import mesh_axes, ring, ulysses


def attention_with_lse(query, key, value, attn_mask=None, *, scale: float | None = None):
    """(output in float32, log-sum-exp of the scaled scores (B, H, Sq)) for a boolean or additive mask.
    Rows with no allowed key give zeros and -inf."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bhqd,bhkd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    if attn_mask is not None and attn_mask.dtype == jnp.bool_:
        scores = jnp.where(attn_mask, scores, -jnp.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask.astype(jnp.float32)
    top = jnp.max(scores, axis=-1, keepdims=True)
    finite_top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(scores - finite_top)
    total = weights.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, value.astype(jnp.float32)) / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, finite_top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse[..., 0]


def xla_attention(query, key, value, attn_mask=None, *, scale: float | None = None):
    """Softmax attention for any boolean or additive mask. Rows with no allowed key give zeros, as
    PyTorch's SDPA does (torchax's own lowering gives NaN there, which HunyuanVideo-1.5's fully masked
    padding rows would spread to every token in the next block)."""
    return attention_with_lse(query, key, value, attn_mask, scale=scale)[0].astype(query.dtype)


def xla_sequence_parallel_attention(query, key, value, attn_mask, *, scale, mesh: Mesh, scheme: str):
    """`xla_attention` with the sequence split on `mesh`'s `sp` axis, by `scheme` "ulysses" or "ring"
    (tpu_video/attention/sequence_parallel.py). A boolean mask travels as its key and query validity
    (masks_from_attn_mask), padded where the sequence is padded to divide by `sp`."""
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    batch_axis, head_axis, sp = mesh_axes(mesh, batch, heads)
    key_valid, query_valid = masks_from_attn_mask(attn_mask, batch, q_len, kv_len)
    q_pad, kv_pad = round_up(q_len, sp), round_up(kv_len, sp)
    key_valid = padded_validity(key_valid, batch, kv_len, kv_pad)
    query_valid = padded_validity(query_valid, batch, q_len, q_pad)
    q, k, v = pad_sequence(query, q_pad), pad_sequence(key, kv_pad), pad_sequence(value, kv_pad)

    def allowed(key_valid, query_valid):
        return query_valid[:, None, :, None] & key_valid[:, None, None, :]

    if scheme == "ulysses":

        def local(q, k, v, key_valid, query_valid):
            return xla_attention(q, k, v, allowed(key_valid, query_valid), scale=scale)

        whole = P(batch_axis, None)
        out = ulysses(mesh, batch_axis, head_axis, local, (whole, whole))(q, k, v, key_valid, query_valid)
    elif scheme == "ring":

        def chunk(q, k, v, key_valid, query_valid):
            return attention_with_lse(q, k, v, allowed(key_valid, query_valid), scale=scale)

        out = ring(mesh, batch_axis, head_axis, chunk, (P(batch_axis, SP),))(q, k, v, key_valid, query_valid)
    else:
        raise ValueError(f"no sequence-parallel XLA attention for scheme {scheme!r}")
    return out[:, :, :q_len].astype(query.dtype)
