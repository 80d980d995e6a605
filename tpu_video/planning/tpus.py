"""TPU generations and slices: the names users type (`v6e-8`, `v5litepod-8`, `v5p-8`, `tpu7x-8`), the
topology names libtpu takes (`v6e:2x4`), and per-device HBM and peak bf16 FLOP/s (and int8 ops/s) for --plan's
verdicts.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

import sharding
from tpu_video.runtime import placement
from tpu_video.workarounds.libtpu import libtpu_off_tpu

GIB = 2**30


@dataclass(frozen=True)
class Generation:
    """One TPU generation as the tool needs it. Sources: cloud.google.com/tpu/docs/{v5e,v5p,v6e,tpu7x}
    (peak bf16 FLOP/s and HBM per chip, TensorCores per chip, hosts); devices per chip as libtpu's
    compile-only topologies give them (measured: v5p:2x2x1 -> 4 devices, tpu7x:2x2x1 -> 8)."""

    prefix: str  # topology names: "v6e:2x4"
    type_names: tuple[str, ...]  # accelerator types: "v6e-8", "v5litepod-8"
    counts_cores: bool  # the number in an accelerator type counts TensorCores (2 per chip), not chips
    devices_per_chip: int  # JAX devices per chip (megacore chips are one device)
    hbm_per_chip: int  # bytes
    bf16_flops_per_chip: float
    three_d: bool  # 3-D torus topology names (2x2x1) rather than 2-D (2x4)
    single_host_chips: int  # the largest slice on one host; bigger slices have 4 chips per host
    device_kind: str  # what jax reports as `device_kind` on this generation
    # Largest Splash tiles (block_q, block_kv, block_kv_compute) whose kernel fits the core's 16 MiB of
    # scoped VMEM, where the families' defaults do not (None: they do). Measured with the TPU compiler,
    # CogVideoX1.5 and HunyuanVideo-1.5 720p shapes: 3328/2816/256 needs 25.4 MiB on v5e and 28.8 on
    # v5p, 2048/2048/1024 19.5 and 21.6, 1024/1024/512 fits; on v6e and tpu7x all of these compile.
    splash_tile_cap: tuple[int, int, int] | None = None
    # Peak int8 ops/s per chip (`--quantize int8`'s matmuls; twice bf16 on v5e, v5p and v6e). None: the
    # generation's page gives no int8 rate (tpu7x lists fp8), so int8 plans bound its steps at bf16's.
    int8_ops_per_chip: float | None = None


GENERATIONS = {
    "v5e": Generation(
        "v5e", ("v5litepod", "v5e"), False, 1, 16 * GIB, 197e12, False, 8, "TPU v5 lite", (1024, 1024, 512), 394e12
    ),
    "v5p": Generation("v5p", ("v5p",), True, 1, 95 * GIB, 459e12, True, 4, "TPU v5", (1024, 1024, 512), 918e12),
    "v6e": Generation("v6e", ("v6e",), False, 1, 32 * GIB, 918e12, False, 8, "TPU v6 lite", None, 1836e12),
    "tpu7x": Generation("tpu7x", ("tpu7x",), True, 2, 192 * GIB, 2307e12, True, 4, "TPU7x"),
}


def generation_of(device_kind: str) -> Generation | None:
    """The generation of a JAX device (`device.device_kind`), or None off TPU or for one we do not know."""
    return next((g for g in GENERATIONS.values() if g.device_kind == device_kind), None)


# v4 is left out on purpose: libtpu's compile-only v4 topology gives 2 devices per chip, while a v4 VM
# runs one megacore device per chip, so the compiled program would not be the one a v4 runs.
GRIDS_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}


@dataclass(frozen=True)
class Target:
    """A TPU slice to plan for: what the user typed, the generation and the topology name libtpu takes."""

    name: str
    generation: Generation
    topology: str

    @property
    def chips(self) -> int:
        return math.prod(int(size) for size in self.topology.split(":")[1].split("x"))

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def hbm_per_device(self) -> int:
        return self.generation.hbm_per_chip // self.generation.devices_per_chip

    @property
    def bf16_flops_per_device(self) -> float:
        return self.generation.bf16_flops_per_chip / self.generation.devices_per_chip

    @property
    def int8_ops_per_device(self) -> float:
        """The int8 peak, or bf16's where the generation gives none."""
        chip = self.generation.int8_ops_per_chip or self.generation.bf16_flops_per_chip
        return chip / self.generation.devices_per_chip

    @property
    def chips_per_host_bounds(self) -> list[int]:
        """How chips group into hosts (v5e-8 and v6e-8 are one host of 2x4 chips; others 2x2 per host)."""
        return [2, 4, 1] if self.chips == 8 and self.generation.single_host_chips == 8 else [2, 2, 1]

    @property
    def devices_per_host(self) -> int:
        return min(math.prod(self.chips_per_host_bounds), self.chips) * self.generation.devices_per_chip


def parse_target(name: str) -> Target:
    """`v6e-8`, `v5litepod-8`, `v5p-8`, `tpu7x-8` (accelerator types) or `v6e:2x4` (a topology name)."""
    known = ", ".join(f"{g.type_names[0]}-8" for g in GENERATIONS.values())
    if ":" in name:
        prefix, grid = name.split(":", 1)
        generation = GENERATIONS.get(prefix)
        dims = grid.split("x")
        if generation is None or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"unknown TPU topology {name!r} (e.g. v6e:2x4, v5p:2x2x1; or a type: {known})")
        if len(dims) != (3 if generation.three_d else 2):
            raise ValueError(f"{prefix} topologies have {3 if generation.three_d else 2} dimensions, got {name!r}")
        return Target(name, generation, name)
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    generation = next((g for g in GENERATIONS.values() if match and match.group(1) in g.type_names), None)
    if generation is None:
        raise ValueError(f"unknown TPU type {name!r}; known: {known} (other sizes too), or a topology like v6e:2x4")
    count = int(match.group(2))
    chips = count // 2 if generation.counts_cores else count
    grids = GRIDS_3D if generation.three_d else GRIDS_2D
    if chips not in grids:
        sizes = ", ".join(f"{name.split('-')[0]}-{c * 2 if generation.counts_cores else c}" for c in grids)
        raise ValueError(f"{name} is not a slice size this tool maps to a topology ({sizes})")
    return Target(name, generation, f"{generation.prefix}:{grids[chips]}")


def slices(generation: Generation) -> list[Target]:
    """The generation's slices this tool maps to a topology, smallest first."""
    grids = GRIDS_3D if generation.three_d else GRIDS_2D
    unit = 2 if generation.counts_cores else 1
    return [parse_target(f"{generation.type_names[0]}-{chips * unit}") for chips in grids]


def smallest_fitting(fits: Callable[[Target], bool], generation: Generation | None = None, devices: int = 0):
    """Of each generation, the smallest slice where `fits` holds (of `generation`, one with more than
    `devices` devices: the slice that does not fit); generations where none does are left out."""
    found = []
    for each in GENERATIONS.values():
        for target in slices(each):
            if (each != generation or target.devices > devices) and fits(target):
                found.append(target)
                break
    return found


def topology_devices(target: Target) -> list:
    """The abstract devices libtpu gives for `target` (no TPU needed); ValueError for a grid no slice has.
    Built once per target and process: the flag check and each plan read the same devices."""
    return list(_topology_devices(target.topology, tuple(target.chips_per_host_bounds)))


@functools.cache
def _topology_devices(topology_name: str, chips_per_host_bounds: tuple[int, ...]) -> tuple:
    from jax.experimental import topologies

    libtpu_off_tpu()
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=topology_name, chips_per_host_bounds=list(chips_per_host_bounds)
        )
    except Exception as err:  # libtpu's own check (a JaxRuntimeError), e.g. a grid no slice has
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"libtpu knows no TPU topology {topology_name!r} ({reason})") from None
    return tuple(topology.devices)


def topology_mesh(target: Target, shape: sharding.MeshShape) -> Mesh:
    """A dp/sp/tp mesh over the abstract devices of `target`, in the same device order as a real run's
    mesh (placement.make_mesh over jax.devices())."""
    return placement.make_mesh(shape, topology_devices(target))


def host_layout(mesh: Mesh) -> dict[str, Any]:
    """How many hosts the mesh spans and which axes cross a host boundary."""
    hosts = np.vectorize(lambda device: device.process_index)(mesh.devices)
    crossing = [axis for index, axis in enumerate(mesh.axis_names) if (np.diff(hosts, axis=index) != 0).any()]
    return {"hosts": int(len(np.unique(hosts))), "axes_across_hosts": crossing}
