"""Where and how a stage runs its modules: one runtime interface, a plain-PyTorch implementation, timing,
and what every runtime records (library versions; the mesh axis names are sharding.py's; the per-user cache folder is
cli.folders.cache_root).

Stages and families call a `Runtime` and never branch on which one they hold. `TorchRuntime` (here)
runs eagerly on one torch device and treats mesh layouts as no-ops; `torchax_runtime.TorchaxRuntime`
places weights on a dp/sp/tp JAX mesh and jits. This module never imports JAX, so stages 1 and 3 with
`--backend torch` run without it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sharding import Layout
from tpu_video.cli import log


class Runtime(Protocol):
    """What stages and families need from a device runtime."""

    device: torch.device  # where the callers' torch tensors live between calls (the host for torchax)
    libraries: tuple[str, ...]  # distributions whose versions shape its results (recorded)

    def compile(self, module: torch.nn.Module, rules: Any = None, methods: tuple[str, ...] = ("forward",)) -> Any:
        """The module ready to call on this runtime, with `methods` (e.g. ("forward", "cached")) callable
        as attributes. `rules` is a sharding.RuleTable, or a function of the mesh's axis sizes
        ({"dp": 2, ...}) returning one; runtimes without a mesh ignore it."""

    def to_device(self, tree: Any, layout: Layout | None = None) -> Any:
        """The CPU tensors in `tree` on this runtime, laid out as `layout` where there is a mesh."""

    def to_host(self, tensor: Any) -> torch.Tensor:
        """A CPU torch tensor; waits for the device."""

    def constrain(self, tensor: torch.Tensor, layout: Layout, uneven: bool = False) -> torch.Tensor:
        """Inside a compiled forward: pin an activation's layout (a no-op without a mesh); `uneven` splits a
        dimension the axis does not divide (placement.constrain)."""

    def barrier(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inside a compiled forward: the tensors unchanged, but nothing that reads one of the results can be
        computed before all of them are (jax.lax.optimization_barrier); eagerly, the tensors themselves."""

    def scan(self, body: Callable, carry: tuple, weights: Any) -> tuple:
        """Inside a compiled forward: `carry = body(carry, slice)` for each slice of `weights` (a pytree of
        tensors: the stacked weights, and any per-block inputs) along their first dimension, as one loop in the
        program (jax.lax.scan; eagerly, a Python loop). `body` is traced once: checks inside it
        (tpu_video.program_checks) hold for every slice."""

    def profile_trace(self) -> contextlib.AbstractContextManager:
        """A profiler trace around the block, or a context that does nothing."""

    def precision(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """Around a stage's work in `dtype`: fp32 means fp32 matmuls where the runtime's default is less."""

    def attention(self, plan) -> contextlib.AbstractContextManager:
        """Within the block, `scaled_dot_product_attention` in compiled programs runs attention plan `plan`'s
        backend (tpu_video/runtime/sdpa.py); eagerly, PyTorch's own."""

    def describe(self) -> str:
        """Where it runs, for log lines."""

    def report(self) -> dict[str, Any]:
        """At the end of a stage: the fields its config section records about where it ran."""


class TorchRuntime:
    """Runs modules eagerly in PyTorch on one device (CPU or CUDA); the no-JAX backend of stages 1 and 3."""

    libraries = ("torch",)

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def compile(self, module: torch.nn.Module, rules: Any = None, methods: tuple[str, ...] = ("forward",)):
        return module.to(self.device)

    def to_device(self, tree: Any, layout: Layout | None = None) -> Any:
        return torch.utils._pytree.tree_map(lambda t: t.to(self.device) if torch.is_tensor(t) else t, tree)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu")

    def constrain(self, tensor: torch.Tensor, layout: Layout, uneven: bool = False) -> torch.Tensor:
        return tensor

    def barrier(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    def scan(self, body: Callable, carry: tuple, weights: Any) -> tuple:
        leaves, spec = torch.utils._pytree.tree_flatten(weights)
        for index in range(len(leaves[0])):
            carry = body(carry, torch.utils._pytree.tree_unflatten([leaf[index] for leaf in leaves], spec))
        return carry

    def profile_trace(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def precision(self, dtype: torch.dtype) -> Iterator[None]:
        """fp32: full-precision fp32 matmuls even where the caller allowed TF32 (torch's "high"/"medium")."""
        previous = torch.get_float32_matmul_precision()
        if dtype == torch.float32:
            torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)

    def attention(self, plan) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def describe(self) -> str:
        return f"torch on {self.device}"

    def report(self) -> dict[str, Any]:
        return {"backend": "torch", "device": str(self.device)}


@dataclass
class ProgramTimes:
    """Seconds this process spent building device programs (runtime.programs adds to PROGRAM_TIMES)."""

    trace: float = 0.0
    compile: float = 0.0
    executables: float = 0.0  # keying, loading and saving saved executables (tpu_video/runtime/executables.py)
    programs: int = 0  # built or loaded


PROGRAM_TIMES = ProgramTimes()


class Timer:
    """Collects named wall-clock phases ({"load": 1.2, "denoise": 30.5}) and per-step seconds. What a
    phase spent building device programs (PROGRAM_TIMES) is moved out of it into the phases `trace`,
    `compile` and `executables` (finding, loading and saving saved ones), so every stage's table names
    that time wherever the first call happens."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = {}
        self.step_seconds: list[float] = []
        self.step_kinds: list[str] = []  # optional, one per step (e.g. "full", "cached" with a step cache)
        self.clock = clock
        self._start = clock()

    def finish(self) -> dict[str, float]:
        """Add `other` (time outside every phase: imports, setup, checks) and `total`, print the phases
        as a small table; returns the phases."""
        total = self.clock() - self._start
        self.seconds["other"] = round(max(total - sum(self.seconds.values()), 0.0), 4)
        self.seconds["total"] = round(total, 4)
        rows = {**self.seconds, **self.median_steps()}
        width = max(len(name) for name in rows)
        log("timing (seconds):")
        for name, seconds in rows.items():
            print(f"    {name:<{width}}  {seconds:9.3f}", flush=True)
        return self.seconds

    def median_steps(self) -> dict[str, float]:
        """{"median step": s}, or with steps of several kinds one median per kind ("median full step")."""
        kinds = self.step_kinds if len(self.step_kinds) == len(self.step_seconds) else [""] * len(self.step_seconds)
        medians = {}
        for kind in dict.fromkeys(kinds):
            steps = sorted(s for s, k in zip(self.step_seconds, kinds, strict=True) if k == kind)
            medians[f"median {kind} step" if len(set(kinds)) > 1 else "median step"] = steps[len(steps) // 2]
        return medians

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block under `name`, less the programs it built (see the class); a phase entered
        again accumulates."""
        built = PROGRAM_TIMES.programs, PROGRAM_TIMES.trace, PROGRAM_TIMES.compile, PROGRAM_TIMES.executables
        start = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - start
            if PROGRAM_TIMES.programs > built[0]:
                for part, before in zip(("trace", "compile", "executables"), built[1:], strict=True):
                    seconds = getattr(PROGRAM_TIMES, part) - before
                    if seconds or part != "executables":  # that row only where a store is used
                        self._add(part, seconds)
                    spent -= seconds
            self._add(name, max(spent, 0.0))

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 4)


def library_versions(*names: str) -> dict[str, str]:
    """Versions of the installed distributions that shaped a stage's output."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def run_record(runtime, dtype: str, seconds: dict[str, float], versions: tuple[str, ...]) -> dict[str, Any]:
    """The fields every stage section shares: where it ran (the runtime's report: backend, devices,
    mesh, placement, compile cache), the dtype, the timing table and the library versions that shaped
    its output (`versions` plus the runtime's own). Call once, at the end of the stage."""
    names = dict.fromkeys((*versions, *runtime.libraries))  # ordered, without repeats
    return {**runtime.report(), "dtype": dtype, "seconds": seconds, "versions": library_versions(*names)}
