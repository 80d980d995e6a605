"""Plain softmax attention in float64 with NumPy: the reference every attention backend is checked against
(tests, benchmarks/attention_exactness.py). Not used on any run's path."""

from __future__ import annotations

import numpy as np


def reference_attention(query, key, value, allowed=None, *, bias=None, scale=None) -> np.ndarray:
    """Softmax attention in float64, the one reference every attention test compares against.

    Inputs (B, H, S, D). `allowed` is a boolean mask and `bias` an additive one, each broadcastable to
    (B, H, Sq, Skv). Rows with no allowed key give zeros, as PyTorch's SDPA does."""
    query, key, value = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    scale = 1 / np.sqrt(query.shape[-1]) if scale is None else scale
    scores = np.einsum("bhqd,bhkd->bhqk", query, key) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float64)
    if allowed is not None:
        scores = np.where(np.asarray(allowed), scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0))
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bhkd->bhqd", weights, value)
