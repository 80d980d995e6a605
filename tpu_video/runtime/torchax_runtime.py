"""Running stock PyTorch modules on JAX devices through torchax: the one place that sets up its environment.

`TorchaxRuntime` implements runtime.Runtime on a dp/sp/tp mesh. Stage 2 (and stages 1 and 3 with
`--backend torchax`) hand modules to `TorchaxRuntime.compile`, which places the weights on the mesh by
a rule table (sharding.py; tpu_video/runtime/placement.py places them) and returns the module with its methods as
compiled programs (tpu_video/runtime/programs.py). Attention is torchax's lowering of
`torch.nn.functional.scaled_dot_product_attention` unless an attention plan overrides it (`attention`:
runtime.sdpa.attention_backend; stage 2's plan, LTX-2's text connectors' XLA einsums);
`torch.gather` is lowered by workarounds.torchax.take_along_axis_gather. `CompileCache` turns on JAX's
persistent compilation cache.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh

import sharding
from tpu_video import program_checks
from tpu_video.cli import log
from tpu_video.cli.folders import cache_root
from tpu_video.runtime import placement
from tpu_video.runtime.executables import store_from_flag
from tpu_video.runtime.programs import Programs
from tpu_video.workarounds.torchax import (
    import_torchax,
    install_gather,
    install_group_norm,
    install_int_mm,
    install_repeat_interleave,
    install_repeat_upsample,
    install_zero_unattended_rows_sdpa,
)

torchax = import_torchax()


def compile_cache_dir() -> Path:
    """JAX_COMPILATION_CACHE_DIR, else a folder in this tool's per-user cache."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    return cache_root() / "jax-compilation-cache"


def device_memory() -> int | None:
    """Bytes one local device can hold, where JAX says (TPU, GPU); None on CPU."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


class CompileCache:
    """The persistent JAX compilation cache, on for every compile in this process, counting hits and misses.

    Compiles of any size are cached: the defaults skip entries that compiled in under a second, which
    is most of what a CPU test run compiles.
    """

    def __init__(self, enabled: bool = True) -> None:
        from jax.experimental.compilation_cache import compilation_cache

        self.enabled = enabled
        self.directory = compile_cache_dir()
        self.hits = self.misses = 0
        if enabled:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", str(self.directory))
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.monitoring.register_event_listener(self._count)
        self.listening = enabled
        # Set both ways: in one process (the Python API) a run with --no_compile_cache must not turn it off for
        # the runs after it.
        jax.config.update("jax_enable_compilation_cache", enabled)
        # JAX settles its cache state at the first compile, and `import torchax` (above) already
        # compiles (with $JAX_COMPILATION_CACHE_DIR if set): start over so the settings above take effect.
        compilation_cache.reset_cache()

    def _count(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def report(self) -> dict[str, object]:
        """Stop counting; a summary for the config (the folder is logged, not recorded: configs hold no
        host paths). Several folders' sections ask once each: the counts are the run's so far."""
        if self.listening:
            self.listening = False
            jax.monitoring.unregister_event_listener(self._count)
            log(f"compile cache {self.directory}: {self.hits} hits, {self.misses} misses")
        return {"enabled": self.enabled, "hits": self.hits, "misses": self.misses}


class TorchaxRuntime:
    """Places modules and tensors on a JAX device mesh and jits module forwards (runtime.Runtime)."""

    device = torch.device("cpu")  # callers' torch tensors: they reach and leave the mesh through the host
    libraries = ("torch", "jax", "jaxlib", "torchax")

    def __init__(
        self,
        mesh: Mesh | None = None,
        profile_dir: str | None = None,
        compile_cache: CompileCache | None = None,
        executables: str = "off",
    ) -> None:
        self.env = torchax.default_env()
        install_gather(self.env)
        install_group_norm(self.env)
        install_repeat_upsample(self.env)
        install_repeat_interleave(self.env)
        install_int_mm(self.env)
        install_zero_unattended_rows_sdpa(self.env)
        self.mesh = mesh if mesh is not None else placement.make_mesh(sharding.MeshShape())
        self.placements: list[dict[str, object]] = []  # every compiled module's, in order
        self.profile_dir = profile_dir
        self.compile_cache = compile_cache  # None: the process's cache settings are left as they are
        self.executables = store_from_flag(executables, self.platform)  # `--executables`
        if self.executables.enabled:
            log(f"executables: {self.executables.directory}")

    @classmethod
    def on_all_devices(cls, axis: str, compile_cache: bool = True, executables: str = "auto") -> TorchaxRuntime:
        """Every JAX device on mesh axis `axis` (stages 1 and 3), with the persistent compile cache and
        the executable store `executables` (`--executables`)."""
        cache = CompileCache(enabled=compile_cache)
        mesh = placement.make_mesh(sharding.MeshShape(**{axis: jax.device_count()}))
        return cls(mesh, compile_cache=cache, executables=executables)

    def program_fingerprint(self) -> dict:
        """What a program holding this runtime's methods (constrain, barrier) reads of it: the mesh
        (tpu_video/runtime/program_key.py; the attention op and the environment are keyed apart)."""
        return {"mesh": self.mesh}

    def profile_trace(self) -> contextlib.AbstractContextManager:
        """A JAX profiler trace writing to `profile_dir` (view with TensorBoard/XProf), if one was given."""
        return jax.profiler.trace(self.profile_dir) if self.profile_dir else contextlib.nullcontext()

    def describe(self) -> str:
        devices = self.mesh.devices.flatten()
        mesh = " ".join(f"{axis}={size}" for axis, size in self.mesh.shape.items())
        return f"torchax on {len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind}), mesh {mesh}"

    def report(self) -> dict[str, Any]:
        """The config fields; also stops the compile cache's counters and logs them."""
        devices = self.mesh.devices.flatten()
        fields: dict[str, Any] = {
            "backend": "torchax",
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "mesh": dict(self.mesh.shape),
            "placement": self.placements,
        }
        if self.compile_cache is not None:
            fields["compile_cache"] = self.compile_cache.report()
        fields["executables"] = self.executables.report()
        return fields

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def compile(self, module: torch.nn.Module, rules: Any = None, methods: tuple[str, ...] = ("forward",)):
        """The module's weights placed on the mesh by `rules` (a sharding.RuleTable or a function of the
        mesh's axis sizes returning one; default: replicated), its `methods` jitted (one program each). A
        weight holding NaN or Inf is a UserError naming it, before anything compiles."""
        if callable(rules):
            rules = rules(dict(self.mesh.shape))
        stats = placement.place_module(module, rules or sharding.REPLICATED_TABLE, self.mesh, self.env)
        log(
            f"placed {stats['rule_table']}: {stats['sharded']} sharded, {stats['replicated']} replicated "
            f"parameters ({stats['read_from_files']} read from their files), {stats['buffers']} buffers, "
            f"{stats['bytes_per_device'] / 2**20:.1f} MiB per device"
        )
        self.placements.append(stats)
        return Programs(module, methods, self.executables, self.mesh)

    def precision(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """fp32 runs with fp32 matmuls. JAX's default precision lets float32 dots run in TF32 on NVIDIA
        GPUs (and in bf16 passes on TPUs, per JAX's docs): on an H100, tiny HunyuanVideo-1.5's fp32 stage-2
        latents differed from the CPU's by 6.1e-4 relative, and by 5.6e-7 with this. bf16 and fp16 keep
        the default: their matmuls already accumulate in fp32."""
        return jax.default_matmul_precision("highest") if dtype == torch.float32 else contextlib.nullcontext()

    def attention(self, plan) -> contextlib.AbstractContextManager:
        """Within the block, SDPA in this runtime's programs runs `plan`'s backend on its mesh."""
        from tpu_video.runtime.sdpa import attention_backend

        return attention_backend(self.env, plan, self.mesh)

    def to_device(self, tree, layout: tuple | None = None):
        """The CPU tensors in `tree` as torchax tensors laid out as `layout` on the mesh (default: replicated)."""
        return placement.place(tree, self.mesh, layout or (), self.env)

    def constrain(self, tensor: torch.Tensor, layout: tuple, uneven: bool = False) -> torch.Tensor:
        """Inside a compiled forward: pin an activation's layout (e.g. the CFG batch on `dp`); `uneven`
        splits a dimension the axis does not divide (placement.constrain)."""
        return placement.constrain(tensor, self.mesh, layout, uneven)

    def barrier(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inside a compiled forward: `tensors` through one jax.lax.optimization_barrier, so what reads the
        results waits for all of them (e.g. a block's timestep-only work for the previous block's output)."""
        from torchax.interop import call_jax

        return tuple(call_jax(jax.lax.optimization_barrier, tensors))

    def scan(self, body, carry: tuple, weights) -> tuple:
        """Inside a compiled forward: `body` (a torch function of (carry, one slice of `weights`)) under
        jax.lax.scan. The checks the body hands over (tpu_video.program_checks) come out of the loop as one
        flag per message and slice and are handed on, reduced, to the program around it."""
        from torchax.interop import call_jax

        traced: list[tuple[str, ...]] = []

        def step(carry, weights):
            with program_checks.collecting() as found:
                carry = body(carry, weights)
            flags, messages = program_checks.flags_by_message(found)
            traced.append(messages)
            return carry, flags

        carry, flags = call_jax(jax.lax.scan, step, carry, weights)
        for flag, message in zip(flags, traced[-1], strict=True):
            program_checks.check(jax.numpy.any(flag.jax()), message)
        return carry

    def to_host(self, tensor) -> torch.Tensor:
        """A CPU torch tensor; blocks until the device has computed it. With several processes each gets
        the whole value (every host runs the same scheduler step on it)."""
        array = tensor.jax()
        if not array.is_fully_addressable:
            from jax.experimental import multihost_utils

            array = multihost_utils.process_allgather(array, tiled=True)
        array = np.array(jax.device_get(array))  # a writable host copy
        if array.dtype == jax.numpy.bfloat16:  # numpy has no bf16 that torch reads: move the bits as uint16
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)
