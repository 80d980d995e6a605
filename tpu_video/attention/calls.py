"""What an attention call's shapes cannot tell the backends: whether its keys are another sequence than
its queries (a cross-attention, e.g. Wan's video tokens attending to the prompt). A family marks its
cross-attention modules once; the dispatch then keeps position-based options (the Splash local window)
to self-attention, where query i and key i are the same token. No JAX: the marks are set at trace time."""

from __future__ import annotations

import contextvars
import functools

import torch

_CROSS_ATTENTION = contextvars.ContextVar("cross_attention", default=False)


def mark_cross_attention(module: torch.nn.Module) -> None:
    """Attention calls made inside `module`'s forward are cross-attention (idempotent)."""
    if getattr(module.forward, "marks_cross_attention", False):
        return
    forward = module.forward

    @functools.wraps(forward)
    def marked(*args, **kwargs):
        token = _CROSS_ATTENTION.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _CROSS_ATTENTION.reset(token)

    marked.marks_cross_attention = True
    module.forward = marked


def in_cross_attention() -> bool:
    return _CROSS_ATTENTION.get()
