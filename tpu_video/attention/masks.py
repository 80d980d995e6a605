"""Boolean attention masks as the per-token validity vectors every exact backend works from."""

from __future__ import annotations

import jax.numpy as jnp

from tpu_video.program_checks import check

# Dense (.., Sq, Skv) masks are reduced and checked only up to this size (HunyuanVideo-1.5's token
# refiner: 1000 x 1000); at video lengths (~112k tokens) the S x S work itself is the problem.
DENSE_MASK_LIMIT = 4096 * 4096


INEXACT_MASK = (
    "splash attention got a dense attention mask that is not (valid query) x (valid key); "
    "only key-padding masks and their outer-product form can be computed exactly"
)
HEADS_DIFFER = (
    "splash attention got key masks that differ between heads; one key mask per sample (every head alike) "
    "can be computed exactly"
)


def masks_from_attn_mask(attn_mask, batch: int, q_len: int, kv_len: int):
    """(key_valid (B, Skv), query_valid (B, Sq) or None) from a boolean SDPA mask.

    Accepts (B, Skv), (B, 1, 1, Skv), the per-head key mask (B, H, 1, Skv) whose heads agree (diffusers'
    `prepare_attention_mask` repeats a key mask per head: LTX-2's text attention), and the dense
    (B, H or 1, Sq, Skv) form `valid_q & valid_k` that HunyuanVideo-1.5 builds (per head in its token
    refiner). The dense form is reduced with `any` over each axis (XLA fuses the reductions, so no second
    S x S array appears); a dense mask that is not such an outer product, or heads that disagree, cannot be
    expressed and raise (when traced, through tpu_video.program_checks: one scalar the program returns).
    """
    if attn_mask is None:
        return None, None
    if attn_mask.dtype != jnp.bool_:
        raise ValueError(f"splash attention takes boolean masks; got {attn_mask.dtype}")
    if attn_mask.ndim == 2:
        return jnp.broadcast_to(attn_mask, (batch, kv_len)), None
    if attn_mask.ndim != 4:
        raise ValueError(
            "splash attention takes masks shaped (B, Skv), (B, 1, 1, Skv) or (B, H or 1, Sq, Skv); "
            f"got {tuple(attn_mask.shape)}"
        )
    if attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
        return jnp.broadcast_to(attn_mask[:, 0, 0, :], (batch, kv_len)), None
    if attn_mask.shape[2] == 1:  # a key mask per head: one query row, so never the S x S dense path
        key_valid = attn_mask[:, 0, 0, :]
        check((attn_mask != key_valid[:, None, None, :]).any(), HEADS_DIFFER)
        return jnp.broadcast_to(key_valid, (batch, kv_len)), None
    if q_len * kv_len > DENSE_MASK_LIMIT:
        raise ValueError(
            f"splash attention refuses a dense {q_len} x {kv_len} attention mask (limit {DENSE_MASK_LIMIT} "
            "entries): pass the per-key mask, shaped (B, Skv) or (B, 1, 1, Skv)"
        )
    dense = jnp.broadcast_to(attn_mask, (batch, attn_mask.shape[1], q_len, kv_len))
    key_valid, query_valid = dense.any(axis=(1, 2)), dense.any(axis=(1, 3))
    inexact = (dense != (query_valid[:, None, :, None] & key_valid[:, None, None, :])).any()
    check(inexact, INEXACT_MASK)
    return key_valid, query_valid


def rows_with_a_key(key_valid, q_len: int, window: int | None):
    """(B, Sq): whether query i can see any valid key (within its window, if any). The kernel's softmax
    is undefined for the others; PyTorch returns zeros there, and so do we."""
    if window is None:
        return jnp.broadcast_to(key_valid.any(axis=1)[:, None], (key_valid.shape[0], q_len))
    counts = jnp.pad(jnp.cumsum(key_valid.astype(jnp.int32), axis=1), ((0, 0), (1, 0)))
    positions = jnp.arange(q_len)
    last = jnp.minimum(positions + window + 1, key_valid.shape[1])
    first = jnp.maximum(positions - window, 0)
    return (counts[:, last] - counts[:, first]) > 0


def padded_validity(valid, batch: int, length: int, padded_length: int):
    """(B, padded_length) bool: `valid` (None = all valid) with the padding beyond `length` invalid."""
    valid = jnp.ones((batch, length), dtype=bool) if valid is None else jnp.broadcast_to(valid, (batch, length))
    return jnp.pad(valid.astype(bool), ((0, 0), (0, padded_length - length)))


def pad_sequence(tensor, length: int):
    """(B, H, S, D) zero-padded along S to `length`."""
    return jnp.pad(tensor, ((0, 0), (0, 0), (0, length - tensor.shape[2]), (0, 0)))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
