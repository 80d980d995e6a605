"""Every device program of the three stages is built here: a module's methods jitted as torchax's
`JittableModule` jits them (weights and buffers are arguments, never constants baked into the program),
but lowered and compiled explicitly, once per input signature, so that tracing (Python running the
torch forward into a JAX program) and compiling (XLA) are timed apart, and so that the
compiled executable is in our hands: saved to and loaded from an executable store
(runtime/executables.py) when the runtime has one. The seconds are added to
runtime.interface.PROGRAM_TIMES, which every stage's Timer reads.
"""

from __future__ import annotations

import contextlib
import functools
import time

import jax
import torch

from runtime import program_checks, program_key
from runtime.interface import PROGRAM_TIMES
from workarounds.jax import without_compilation_cache
from workarounds.torchax import import_torchax, op_definition

interop = import_torchax().interop


def signature(tree) -> tuple:
    """What a compiled program is specialised to: the inputs' structure and each array's shape, dtype and
    sharding (Python scalars by type only: jit traces them as values, as jax.jit does)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(
        (leaf.shape, leaf.dtype, leaf.sharding) if isinstance(leaf, jax.Array) else type(leaf) for leaf in leaves
    )


class Programs(interop.JittableModule):
    """`module` with `methods` as compiled programs (each call with a new input signature builds one, or
    loads it from `store`). Checks inside a program (runtime.program_checks) come back as extra outputs
    and raise after the call."""

    def __init__(self, module: torch.nn.Module, methods: tuple[str, ...], store=None, mesh=None) -> None:
        super().__init__(module)
        self._state = interop.jax_view((self.params, self.buffers))  # placed once; every call passes them
        self._store = store if store is not None and store.enabled else None
        self._mesh = mesh
        for method in methods:
            self._jitted[method] = self._program(method)

    def _program(self, method: str):
        function = interop.jax_view(functools.partial(self.functional_call, method))
        traced_messages: list[tuple[str, ...]] = []

        def checked(*args, **kwargs):
            with program_checks.collecting() as found:
                out = function(*args, **kwargs)
            flags, messages = program_checks.flags_by_message(found)
            traced_messages.append(messages)
            return out, flags

        jitted = jax.jit(checked)
        executables = {}

        def call(*args, **kwargs):
            inputs = interop.jax_view((args, kwargs))
            key = signature(inputs)
            if key not in executables:
                executables[key] = self._ready(method, jitted, inputs, traced_messages)
            executable, messages = executables[key]
            args, kwargs = inputs
            out, flags = executable(*self._state, *args, **kwargs)
            program_checks.raise_failed(flags, messages)
            return interop.torch_view(out)

        return call

    def _ready(self, method: str, jitted, inputs, traced_messages: list):
        """(executable, check messages): loaded from the store, else traced and compiled (and saved)."""
        name = f"{program_key.qualified(type(self._model))}.{method}"
        parts = None
        if self._store is not None:
            start = time.perf_counter()
            try:
                parts = self._parts(method, inputs)
            except program_key.ProgramKeyError as error:
                self._store.unsaveable(name, str(error))
            except Exception as error:  # describing must never stop a run: compile as without a store
                self._store.unsaveable(name, f"describing it failed: {type(error).__name__}: {error}")
            loaded = parts and self._store.load(name, parts, self._mesh.devices.flatten())
            PROGRAM_TIMES.executables += time.perf_counter() - start
            if loaded:
                PROGRAM_TIMES.programs += 1
                return loaded
        with without_compilation_cache() if parts else contextlib.nullcontext():
            executable = self._build(jitted, self._state, inputs)
        messages = traced_messages[-1]
        if parts:
            start = time.perf_counter()
            self._store.save(name, parts, executable, messages)
            PROGRAM_TIMES.executables += time.perf_counter() - start
        return executable, messages

    def _parts(self, method: str, inputs) -> dict:
        env = import_torchax().default_env()
        attention = op_definition(env, torch.nn.functional.scaled_dot_product_attention)
        context = program_key.environment_parts(self._mesh)
        return program_key.program_parts(self._model, method, self._state, inputs, context, attention)

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
