"""Every device program of the three stages is built here: a module's methods jitted as torchax's
`JittableModule` jits them (weights and buffers are arguments, never constants baked into the program),
but lowered and compiled explicitly, once per input signature, so that tracing (Python running the
torch forward into a JAX program) and compiling (XLA) are timed apart, and so that the
compiled executable is in our hands: the place saved executables will go. The seconds are added to
runtime.interface.PROGRAM_TIMES, which every stage's Timer reads.
"""

from __future__ import annotations

import functools
import time

import jax
import torch

from runtime.interface import PROGRAM_TIMES
from workarounds.torchax import import_torchax

interop = import_torchax().interop


def signature(tree) -> tuple:
    """What a compiled program is specialised to: the inputs' structure and each array's shape, dtype and
    sharding (Python scalars by type only: jit traces them as values, as jax.jit does)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(
        (leaf.shape, leaf.dtype, leaf.sharding) if isinstance(leaf, jax.Array) else type(leaf) for leaf in leaves
    )


class Programs(interop.JittableModule):
    """`module` with `methods` as compiled programs (each call with a new input signature builds one)."""

    def __init__(self, module: torch.nn.Module, methods: tuple[str, ...]) -> None:
        super().__init__(module)
        self._state = interop.jax_view((self.params, self.buffers))  # placed once; every call passes them
        for method in methods:
            self._jitted[method] = self._program(method)

    def _program(self, method: str):
        jitted = jax.jit(interop.jax_view(functools.partial(self.functional_call, method)))
        executables = {}

        def call(*args, **kwargs):
            inputs = interop.jax_view((args, kwargs))
            key = signature(inputs)
            if key not in executables:
                executables[key] = self._build(jitted, self._state, inputs)
            args, kwargs = inputs
            return interop.torch_view(executables[key](*self._state, *args, **kwargs))

        return call

    def _build(self, jitted, state, inputs):
        args, kwargs = inputs
        start = time.perf_counter()
        lowered = jitted.lower(*state, *args, **kwargs)
        traced = time.perf_counter()
        executable = lowered.compile()
        PROGRAM_TIMES.trace += traced - start
        PROGRAM_TIMES.compile += time.perf_counter() - traced
        PROGRAM_TIMES.programs += 1
        return executable
