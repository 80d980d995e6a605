"""`--plan`: compile the exact stage-2 denoiser (or stage-3 decode) for a real TPU topology on any host.

libtpu compiles for a TPU topology without a TPU (`jax.experimental.topologies`). The module is built
on the meta device, its weights passed as `jax.ShapeDtypeStruct`s placed by the family's rule table,
and the Splash kernel lowered by Mosaic (`interpret=False`). What the compiler returns is the report:
per-device HBM (memory analysis) against the device's capacity, collectives (TPU HLO), FLOPs (XLA's
cost analysis plus the attention FLOPs the custom call hides) and the padding Splash adds.
Nothing about a TPU in this repository is claimed without this compiler.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding

import hlo
import sharding
from runtime import quiet_libtpu

GIB = 2**30
DOES_NOT_FIT_EXIT_STATUS = 3


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


GENERATIONS = {
    "v5e": Generation("v5e", ("v5litepod", "v5e"), False, 1, 16 * GIB, 197e12, False, 8),
    "v5p": Generation("v5p", ("v5p",), True, 1, 95 * GIB, 459e12, True, 4),
    "v6e": Generation("v6e", ("v6e",), False, 1, 32 * GIB, 918e12, False, 8),
    "tpu7x": Generation("tpu7x", ("tpu7x",), True, 2, 192 * GIB, 2307e12, True, 4),
}
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
    def chips_per_host_bounds(self) -> list[int]:
        """How chips group into hosts (v5e-8 and v6e-8 are one host of 2x4 chips; others 2x2 per host)."""
        return [2, 4, 1] if self.chips == 8 and self.generation.single_host_chips == 8 else [2, 2, 1]


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


def topology_mesh(target: Target, shape: sharding.MeshShape) -> Mesh:
    """A dp/sp/tp mesh over the abstract devices of `target` (no TPU needed)."""
    from jax.experimental import topologies

    quiet_libtpu()
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=target.topology, chips_per_host_bounds=target.chips_per_host_bounds
    )
    # The same device order as a real run's mesh (sharding.make_mesh over jax.devices()).
    return sharding.make_mesh(shape, topology.devices)


def host_layout(mesh: Mesh) -> dict[str, Any]:
    """How many hosts the mesh spans and which axes cross a host boundary."""
    hosts = np.vectorize(lambda device: device.process_index)(mesh.devices)
    crossing = [axis for index, axis in enumerate(mesh.axis_names) if (np.diff(hosts, axis=index) != 0).any()]
    return {"hosts": int(len(np.unique(hosts))), "axes_across_hosts": crossing}


# Abstract programs ---------------------------------------------------------------------------------

_JAX_DTYPES = {
    torch.float32: jax.numpy.float32,
    torch.float64: jax.numpy.float32,  # JAX without x64, as torchax runs
    torch.bfloat16: jax.numpy.bfloat16,
    torch.float16: jax.numpy.float16,
    torch.int64: jax.numpy.int32,
    torch.int32: jax.numpy.int32,
    torch.bool: jax.numpy.bool_,
}


def abstract(tensor: torch.Tensor, mesh: Mesh, layout: tuple = ()) -> jax.ShapeDtypeStruct:
    """What a placed tensor looks like to the compiler: shape, dtype and sharding, no data."""
    spec = sharding.fit_spec(sharding.P(*layout), tuple(tensor.shape), mesh)
    return jax.ShapeDtypeStruct(tuple(tensor.shape), _JAX_DTYPES[tensor.dtype], sharding=NamedSharding(mesh, spec))


def meta_module(source, component: str, dtype: torch.dtype, **overrides) -> torch.nn.Module:
    """A component built from its config on the meta device (no weights), in `dtype` as `from_pretrained`
    would load it (modules the class keeps in fp32 stay fp32)."""
    cls = source.component_class(component)
    with torch.device("meta"):
        module = cls.from_config({**source.load_config(component), **overrides}).eval()
    torch.nn.Module.to(module, dtype)  # the plain cast: diffusers' own `to` only warns about fp32 modules
    keep = getattr(cls, "_keep_in_fp32_modules", None) or ()
    for name, submodule in module.named_modules():
        if any(part in keep for part in name.split(".")):
            torch.nn.Module.to(submodule, torch.float32)
    return module


@dataclass
class Compiled:
    """The compiler's answer for one program: analyses, or the HBM it said was missing."""

    seconds: float
    memory: dict[str, int] | None = None
    flops: float = 0.0
    collectives: dict[str, dict[str, int]] | None = None
    hlo_text: str = ""
    refused: dict[str, float] | None = None  # {"required": bytes, "available": bytes} when out of HBM


_OUT_OF_HBM = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_module(module: torch.nn.Module, rules, inputs, mesh: Mesh, env) -> Compiled:
    """Compile `module(*inputs)` for `mesh`'s devices with its parameters placed by `rules` (buffers
    replicated); `inputs` are (tensor or tuple of tensors, layout) pairs. Traced inside `env`."""
    from torchax import interop

    specs = rules.assign([name for name, _ in module.named_parameters()])
    state = {name: abstract(param, mesh, tuple(specs[name])) for name, param in module.named_parameters()}
    state.update({name: abstract(buffer, mesh) for name, buffer in module.named_buffers()})
    arguments = [
        jax.tree.map(lambda tensor, layout=layout: abstract(tensor, mesh, layout), value) for value, layout in inputs
    ]

    def call(state, *arguments):
        return torch.func.functional_call(module, state, tuple(arguments))

    start = time.perf_counter()
    with env:
        lowered = jax.jit(interop.jax_view(call)).lower(state, *arguments)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        found = _OUT_OF_HBM.search(str(err))
        if "RESOURCE_EXHAUSTED" not in str(err) or found is None:
            raise
        required = float(found.group(1)) * _UNITS[found.group(2)]
        available = float(found.group(3)) * _UNITS[found.group(4)]
        return Compiled(time.perf_counter() - start, refused={"required": required, "available": available})
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {
        "arguments": stats.argument_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "code": stats.generated_code_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
    }
    memory["total"] = sum(memory[key] for key in ("arguments", "temporaries", "outputs", "code")) - memory["aliased"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return Compiled(seconds, memory, float(cost.get("flops", 0.0)), hlo.count_collectives(text), text)


# Stage 2 -------------------------------------------------------------------------------------------


def _per_block(full: dict, two: dict, three: dict, layers: int) -> tuple[dict, dict]:
    """Collectives of one block and of the rest of the program.

    A block's collectives are the difference between the program at three and at two blocks: measured
    on the TPU compiler, counts grow linearly from two blocks on, while a lone block can compile a
    little differently. The rest is the full program minus `layers` such blocks; where XLA merges a
    block's collective with its surroundings this can come out negative."""
    per_block, outside = {}, {}
    for op in full:
        block = {key: three[op][key] - two[op][key] for key in full[op]}
        rest = {key: full[op][key] - layers * block[key] for key in full[op]}
        if any(block.values()):
            per_block[op] = block
        if any(rest.values()):
            outside[op] = rest
    return per_block, outside


def _padding(calls) -> list[dict[str, Any]]:
    """The Splash calls by shape, with the tokens padding adds to reach the tiles."""
    shapes: dict[tuple, int] = {}
    for call in calls:
        key = (call.q_len, call.q_padded, call.kv_len, call.kv_padded)
        shapes[key] = shapes.get(key, 0) + 1
    return [
        {
            "calls": count,
            "q_len": q_len,
            "q_padded": q_padded,
            "kv_len": kv_len,
            "kv_padded": kv_padded,
            "q_padding_percent": round(100 * (q_padded - q_len) / q_padded, 2),
            "kv_padding_percent": round(100 * (kv_padded - kv_len) / kv_padded, 2),
        }
        for (q_len, q_padded, kv_len, kv_padded), count in sorted(shapes.items(), reverse=True)
    ]


def plan_stage2(family, source, request, embeds, dtype, target: Target, mesh_shape, tp_mode, attention, splash):
    """Compile stage 2's guided denoiser call (what every step runs) for `target`; the report as a dict.

    The program is built by the family's own `denoise_loop`, as a real run builds it, around a
    meta-device transformer. It is compiled at the model's depth (memory, FLOPs, every collective) and
    at two and three blocks, whose difference gives the collectives of one block."""
    from splash_attention import attention_backend, record_kernel_calls
    from torchax_runtime import TorchaxRuntime

    mesh = topology_mesh(target, mesh_shape)
    runtime = TorchaxRuntime(mesh)  # only its environment and `constrain` are used: nothing is placed
    layers = source.load_config("transformer")["num_layers"]
    compiled, calls = {}, {}
    for depth in sorted({layers, 2, 3}, reverse=True):
        transformer = meta_module(source, "transformer", dtype, num_layers=depth)
        loop, _ = family.denoise_loop(source, request, embeds, dtype, transformer, runtime, tp_mode)
        t = loop.timesteps[0]
        inputs = [(loop.model_input(loop.latents, t), ()), (t.reshape(1), ()), *loop.static_inputs]
        with attention_backend(runtime.env, attention, splash, mesh), record_kernel_calls() as traced:
            compiled[depth] = compile_module(loop.guided, loop.rules.nested("transformer."), inputs, mesh, runtime.env)
        calls[depth] = traced
        if compiled[depth].refused:
            break
    full = compiled[layers]
    report: dict[str, Any] = {
        "stage": 2,
        "target": target.name,
        "topology": target.topology,
        "chips": target.chips,
        "devices": target.devices,
        **host_layout(mesh),
        "mesh": dict(mesh.shape),
        "model": request.model_id,
        "video": {"height": request.height, "width": request.width, "num_frames": request.num_frames},
        "dtype": str(dtype).removeprefix("torch."),
        "tp_mode": tp_mode,
        "attention": attention,
        "compile_seconds": round(full.seconds, 1),
    }
    if full.refused:
        required, available = full.refused["required"], full.refused["available"]
        report.update(
            fits=False,
            hbm_bytes_per_device={"total": required, "capacity": target.hbm_per_device, "compiler_limit": available},
        )
        return report
    memory = {**full.memory, "capacity": target.hbm_per_device}
    attention_flops = sum(call.flops_per_device for call in calls[layers])
    per_block, outside = _per_block(full.collectives, compiled[2].collectives, compiled[3].collectives, layers)
    report.update(
        fits=memory["total"] <= memory["capacity"],
        hbm_bytes_per_device=memory,
        collectives={
            "layers": layers,
            "per_block": per_block,
            "outside_blocks": outside,
            "total": {op: value for op, value in full.collectives.items() if value["count"]},
        },
        flops_per_device={"xla": full.flops, "attention": attention_flops, "total": full.flops + attention_flops},
        step_seconds_lower_bound=(full.flops + attention_flops) / target.bf16_flops_per_device,
        splash_custom_calls=full.hlo_text.count('custom_call_target="tpu_custom_call"'),
        splash_padding=_padding(calls[layers]),
    )
    return report


def print_report(report: dict[str, Any]) -> None:
    """The plan as a few plain lines."""

    def gib(value: float) -> str:
        return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"

    mesh = " ".join(f"{axis}={size}" for axis, size in report["mesh"].items())
    crossing = ", ".join(report["axes_across_hosts"]) or "none"
    print(
        f"plan: stage {report['stage']} of {report['model']} on {report['target']} ({report['topology']}): "
        f"{report['chips']} chips, {report['devices']} devices, {report['hosts']} host(s); mesh {mesh} "
        f"(axes across hosts: {crossing})"
    )
    print(f"  compiled by the TPU compiler in {report['compile_seconds']} s")
    memory = report["hbm_bytes_per_device"]
    if "arguments" in memory:
        parts = ", ".join(f"{key} {gib(memory[key])}" for key in ("arguments", "temporaries", "outputs", "code"))
        print(f"  HBM per device: {parts}; total {gib(memory['total'])} of {gib(memory['capacity'])}")
    else:
        print(f"  HBM per device: the compiler needs {gib(memory['total'])}, has {gib(memory['compiler_limit'])}")
    spare = (
        memory["capacity"] - memory["total"] if "arguments" in memory else memory["compiler_limit"] - memory["total"]
    )
    verdict = f"fits with {gib(spare)} to spare" if report["fits"] else f"does not fit by {gib(-spare)}"
    print(f"  verdict: {verdict}")
    if not report["fits"] and "arguments" not in memory:
        return
    for where in ("per_block", "outside_blocks"):
        found = report["collectives"][where]
        text = "; ".join(
            f"{op} {v['count']} ops, {v['tensors']} tensors, {v['bytes'] / 2**20:.2f} MiB" for op, v in found.items()
        )
        print(f"  collectives {where.replace('_', ' ')}: {text or 'none'}")
    flops = report["flops_per_device"]
    print(
        f"  FLOPs per step per device: {flops['total']:.3e} ({flops['xla']:.3e} XLA + {flops['attention']:.3e} "
        f"attention); at peak bf16 that is at least {report['step_seconds_lower_bound']:.3f} s per step (a lower bound)"
    )
    for shape in report["splash_padding"]:
        print(
            f"  Splash x{shape['calls']}: q {shape['q_len']} -> {shape['q_padded']} "
            f"({shape['q_padding_percent']}% padding), kv {shape['kv_len']} -> {shape['kv_padded']} "
            f"({shape['kv_padding_percent']}%)"
        )
