"""Every device program of the three stages is built here: a module's methods jitted as torchax's
`JittableModule` jits them (weights and buffers are arguments, never constants baked into the program),
but lowered and compiled explicitly, once per input signature, so that tracing (Python running the
torch forward into a JAX program) and compiling (XLA) are timed apart, and so that the
compiled executable is in our hands: saved to and loaded from an executable store
(tpu_video/runtime/executables.py) when the runtime has one. The seconds are added to
runtime.interface.PROGRAM_TIMES, which every stage's Timer reads.
"""

from __future__ import annotations

import contextlib
import functools
import time

import jax
import torch

from tpu_video import program_checks
from tpu_video.cli import still_working
from tpu_video.runtime import program_key
from tpu_video.runtime.interface import PROGRAM_TIMES
from tpu_video.workarounds.jax import without_compilation_cache
from tpu_video.workarounds.torchax import dedup_tied_buffers, import_torchax, op_definition, quiet_attribute_scan

interop = import_torchax().interop


def signature(tree) -> tuple:
    """What a compiled program is specialised to: the inputs' structure and each array's shape, dtype and
    layout (program_key.layout: equivalent shardings are one), Python scalars by type only (jit traces them
    as values, as jax.jit does)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(
        (leaf.shape, leaf.dtype, program_key.layout(leaf.sharding, leaf.shape))
        if isinstance(leaf, jax.Array)
        else type(leaf)
        for leaf in leaves
    )


class Programs(interop.JittableModule):
    """`module` with `methods` as compiled programs (each call with a new input signature builds one, or
    loads it from `store`). Checks inside a program (tpu_video.program_checks) come back as extra outputs
    and raise after the call.

    A run's module has its weights placed (tpu_video/runtime/placement.py). A plan's (tpu_video/planning/plan.py) is on
    the meta device: `abstract` maps each weight's id to the jax.ShapeDtypeStruct it is compiled over, and
    `compile_ahead` builds, and saves, what the run's first call would build for those weights."""

    def __init__(self, module: torch.nn.Module, methods: tuple[str, ...], store=None, mesh=None, abstract=None):
        if abstract is not None:  # placing replaces each Parameter by a plain tensor, which torchax then lists
            module.requires_grad_(False)  # among the buffers: a plan's state takes the same structure
        with quiet_attribute_scan():
            super().__init__(module)
        dedup_tied_buffers(self)
        state = (self.params, self.buffers)
        self._state = interop.jax_view(state) if abstract is None else jax.tree.map(lambda t: abstract[id(t)], state)
        self._store = store if store is not None and store.enabled else None
        self._mesh = mesh
        self._process = None if abstract is None else 0  # a plan's programs are for a single host's process
        self._builders = {}
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

        # keep_unused: a weight the program does not read is on the device all the same (a plan counts it)
        self._builders[method] = jitted, _ = jax.jit(checked, keep_unused=True), traced_messages
        executables = {}

        def call(*args, **kwargs):
            inputs = interop.jax_view((args, kwargs))
            key = signature(inputs)
            if key not in executables:
                executables[key] = self._ready(method, inputs)
            executable, messages = executables[key]
            args, kwargs = inputs
            out, flags = executable(*self._state, *args, **kwargs)
            program_checks.raise_failed(flags, messages)
            return interop.torch_view(out)

        return call

    def _ready(self, method: str, inputs):
        """(executable, check messages): loaded from the store, else traced and compiled (and saved)."""
        name = self._name(method)
        parts = None
        if self._store is not None:
            start = time.perf_counter()
            parts = self._keyed(method, inputs)
            loaded = parts and self._store.load(name, parts, self._mesh.devices.flatten())
            PROGRAM_TIMES.executables += time.perf_counter() - start
            if loaded:
                PROGRAM_TIMES.programs += 1
                return loaded
        return self._compile_and_save(method, inputs, parts)

    def compile_ahead(self, method: str, args: tuple):
        """Trace and compile `method` for abstract `args` (jax.ShapeDtypeStructs) as the run's first call with
        such inputs does, save it to the store if there is one, and return the compiled executable."""
        inputs = (tuple(args), {})
        parts = self._keyed(method, inputs) if self._store is not None else None
        return self._compile_and_save(method, inputs, parts)[0]

    def trace_ahead(self, method: str, args: tuple) -> None:
        """Trace `method` for `args` (tensors or abstract jax.ShapeDtypeStructs) with jax.eval_shape: nothing is
        lowered, compiled, looked up or saved (the step cache's probe, which stops inside the trace)."""
        jax.eval_shape(self._builders[method][0], *self._state, *interop.jax_view(tuple(args)))

    def _name(self, method: str) -> str:
        return f"{program_key.qualified(type(self._model))}.{method}"

    def _keyed(self, method: str, inputs) -> dict | None:
        """The key's parts, or None (logged, counted) where the program cannot be keyed."""
        try:
            return self._parts(method, inputs)
        except program_key.ProgramKeyError as error:
            self._store.unsaveable(self._name(method), str(error))
        except Exception as error:  # describing must never stop a run: compile as without a store
            self._store.unsaveable(self._name(method), f"describing it failed: {type(error).__name__}: {error}")
        return None

    def _compile_and_save(self, method: str, inputs, parts: dict | None):
        jitted, traced_messages = self._builders[method]
        with without_compilation_cache() if parts else contextlib.nullcontext():
            executable = self._build(jitted, self._state, inputs, self._name(method))
        messages = traced_messages[-1]
        if parts:
            start = time.perf_counter()
            self._store.save(self._name(method), parts, executable, messages)
            PROGRAM_TIMES.executables += time.perf_counter() - start
        return executable, messages

    def _parts(self, method: str, inputs) -> dict:
        env = import_torchax().default_env()
        attention = op_definition(env, torch.nn.functional.scaled_dot_product_attention)
        context = program_key.environment_parts(self._mesh, self._process)
        return program_key.program_parts(self._model, method, self._state, inputs, context, attention)

    def _build(self, jitted, state, inputs, name: str):
        args, kwargs = inputs
        start = time.perf_counter()
        with still_working(f"tracing {name}"):
            lowered = jitted.lower(*state, *args, **kwargs)
        traced = time.perf_counter()
        with still_working(f"compiling {name}"):
            executable = lowered.compile()
        PROGRAM_TIMES.trace += traced - start
        PROGRAM_TIMES.compile += time.perf_counter() - traced
        PROGRAM_TIMES.programs += 1
        return executable
