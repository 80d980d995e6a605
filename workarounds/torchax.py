"""Import torchax on a torch that has dropped the named-dimension (Dimname) op overloads, and mend
torchax's `Tensor.type_as`.

torchax 0.0.13 looks up about twenty ``aten.<op>.<Dimname overload>`` attributes while it is imported
and while its default environment is first built (AMP cast tables, decomposition lists). torch 2.13
removed those overloads, so the lookup raises AttributeError and ``import torchax`` fails. We never
call a named-dimension op, so during that window a missing overload resolves to an inert placeholder;
the original lookup is restored right after. ``tests/test_torchax_compat.py`` fails loudly once a
torchax release no longer needs this, so it can be deleted.

torchax 0.0.13's `Tensor.type_as` casts the wrapped JAX array in place and returns `self`, so the
tensor's torch-level dtype stays the old one: the next op that checks dtypes sees a mismatch (the Wan
VAE's `WanUpsample` does `upsample(x.float()).type_as(x)` before a bf16 conv, which then fails with
"Input type (float) and bias type (c10::BFloat16) should be the same"). `cast_type_as` is torch's
meaning, a new tensor; tests/test_upstream_bugs.py checks the stock method still misbehaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch._ops


class MissingOverload:
    """Stands in for an op overload that this torch build no longer has; hashable, never callable."""

    def __init__(self, qualified_name: str) -> None:
        self.qualified_name = qualified_name

    def __repr__(self) -> str:
        return f"<missing overload {self.qualified_name}>"


MISSING_OVERLOADS: list[str] = []
"""Qualified names the last shimmed import had to stand in for (empty if none were needed)."""


@contextlib.contextmanager
def tolerate_missing_overloads() -> Iterator[list[str]]:
    """Within the block, ``torch.ops.aten.<op>.<missing overload>`` yields a MissingOverload."""
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__
    missing: list[str] = []

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            missing.append(f"{self._qualified_op_name}.{key}")
            return MissingOverload(missing[-1])

    packet.__getattr__ = lookup
    try:
        yield missing
    finally:
        packet.__getattr__ = original


def cast_type_as(self, other):
    """torch's `Tensor.type_as`: `self` cast to `other`'s dtype, as a new tensor."""
    return self if self.dtype == other.dtype else self.to(other.dtype)


STOCK_TYPE_AS: list = []  # torchax's own Tensor.type_as, kept for the canary test


def import_torchax():
    """Return the torchax module with its default environment built (the shim covers both steps).

    Building it starts JAX's backends, so they are set up for this host first (workarounds.libtpu.libtpu_off_tpu,
    workarounds.jax.keep_cpu_backend)."""
    from workarounds.jax import keep_cpu_backend
    from workarounds.libtpu import libtpu_off_tpu

    libtpu_off_tpu()
    keep_cpu_backend()
    with tolerate_missing_overloads() as missing:
        import torchax

        torchax.default_env()
    if missing:
        MISSING_OVERLOADS[:] = missing
    if torchax.tensor.Tensor.type_as is not cast_type_as:
        STOCK_TYPE_AS[:] = [torchax.tensor.Tensor.type_as]
        torchax.tensor.Tensor.type_as = cast_type_as
    return torchax
