"""Checks of values a compiled program computes, without host callbacks.

A host callback (`jax.debug.callback`) cannot be saved with a compiled executable, so a program that
holds one could never be reused across processes (tpu_video/runtime/executables.py). Instead, `check` hands a
traced failure flag to the program being built by runtime.programs, which returns it beside the
program's own outputs and raises on the host after the call. Traced anywhere else (a plain `jax.jit`),
it falls back to a host callback; on concrete values it raises at once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

_COLLECTING: list[list[tuple[object, str]]] = []  # one list per program being traced, innermost last


def _raise_if(failed, message: str) -> None:
    if failed:
        raise ValueError(message)


def check(failed, message: str) -> None:
    """ValueError(message) where the boolean scalar `failed` is true (see the module's docstring)."""
    if not isinstance(failed, jax.core.Tracer):
        _raise_if(bool(failed), message)
    elif _COLLECTING:
        _COLLECTING[-1].append((failed, message))
    else:
        jax.debug.callback(functools.partial(_raise_if, message=message), failed)


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[object, str]]]:
    """Around tracing one program: the (flag, message) pairs its `check`s hand over."""
    found: list[tuple[object, str]] = []
    _COLLECTING.append(found)
    try:
        yield found
    finally:
        _COLLECTING.pop()


def flags_by_message(found: list[tuple[object, str]]) -> tuple[tuple, tuple[str, ...]]:
    """One flag per distinct message (any of its checks failed), and the messages, in first-seen order."""
    messages = tuple(dict.fromkeys(message for _, message in found))
    flags = tuple(jnp.any(jnp.stack([flag for flag, m in found if m == message])) for message in messages)
    return flags, messages


def raise_failed(flags, messages: tuple[str, ...]) -> None:
    """After a call: ValueError with the first message whose flag came back true (waits for the program).
    Each flag is a scalar, whole on every device, so any process reads its own copy."""
    for flag, message in zip(flags, messages, strict=True):
        _raise_if(bool(np.asarray(flag.addressable_data(0))), message)
