"""`--plan`: compile the exact stage-2 denoiser (or stage-3 decode) for a real TPU topology on any host.

libtpu compiles for a TPU topology without a TPU (`jax.experimental.topologies`). The module is built
on the meta device, its weights passed as `jax.ShapeDtypeStruct`s placed by the family's rule table,
and the Splash kernel lowered by Mosaic (`interpret=False`). What the compiler returns is the report:
per-device HBM (memory analysis) against the device's capacity, collectives (TPU HLO), FLOPs (XLA's
cost analysis plus the attention FLOPs the custom call hides) and the padding Splash adds.
Nothing about a TPU in this repository is claimed without this compiler.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import torch
from jax.sharding import Mesh

from sharding import REPLICATED_TABLE, TP
from tpu_video.attention.plan import AttentionPlan
from tpu_video.engine.meta import attention_heads, meta_module, meta_transformers, weight_facts
from tpu_video.engine.settings import NO_QUANTIZATION, Quantization
from tpu_video.planning import hlo
from tpu_video.planning.report import STAGE_WORK
from tpu_video.planning.tpus import Target, host_layout, topology_mesh
from tpu_video.runtime import placement
from tpu_video.runtime.interface import PROGRAM_TIMES

# Abstract programs ---------------------------------------------------------------------------------


@dataclass
class Compiled:
    """The compiler's answer for one program: analyses, or the HBM it said was missing."""

    seconds: float
    memory: dict[str, int] | None = None
    flops: float = 0.0
    collectives: dict[str, dict[str, int]] | None = None
    hlo_text: str = ""
    refused: dict[str, float] | None = None  # {"required": bytes, "available": bytes} when out of HBM
    outputs: Any = None  # what the program returns, as jax.ShapeDtypeStructs

    def add_resident(self, size: int) -> None:
        """Count `size` more bytes per device that live outside this program (other experts' weights)."""
        if self.memory is not None:
            self.memory["total"] += size
        elif self.refused is not None:
            self.refused["required"] += size


class KernelDoesNotFit(ValueError):
    """The compiler could not fit a kernel's working set in the core's scoped VMEM (tiles too large)."""


_OUT_OF_VMEM = re.compile(r"Scoped allocation with size ([\d.]+\w) and limit ([\d.]+\w)")
_OUT_OF_HBM = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _programs(module: torch.nn.Module, rules, mesh: Mesh, method: str, store=None):
    """`module.method` as the run's program (tpu_video/runtime/programs.py), over its weights as `rules` place them on
    `mesh`'s devices (buffers replicated), without data."""
    from tpu_video.runtime.programs import Programs

    return Programs(module, (method,), store, mesh, abstract=placement.abstract_weights(module, rules, mesh))


def _abstract_inputs(inputs, mesh: Mesh) -> tuple:
    """(tensor or tuple of tensors, layout) pairs as the arrays a run places from them, without data."""
    return tuple(
        jax.tree.map(
            lambda tensor, layout=layout: placement.abstract(tensor.shape, tensor.dtype, layout, mesh=mesh), value
        )
        for value, layout in inputs
    )


def trace_module(module: torch.nn.Module, rules, inputs, mesh: Mesh, env, method: str = "forward") -> None:
    """Trace `module.method(*inputs)` abstractly (jax.eval_shape): nothing is lowered or compiled."""
    with env:
        _programs(module, rules, mesh, method).trace_ahead(method, _abstract_inputs(inputs, mesh))


def compile_module(
    module: torch.nn.Module, rules, inputs, mesh: Mesh, env, method: str = "forward", store=None
) -> Compiled:
    """Compile `module.method(*inputs)` for `mesh`'s devices with its parameters placed by `rules` (buffers
    replicated); `inputs` are (tensor or tuple of tensors, layout) pairs. Traced inside `env`. The program
    is the one a run builds (tpu_video/runtime/programs.py), so `store` (an ExecutableStore) saves it for runs to
    load."""
    programs = _programs(module, rules, mesh, method, store)
    compiling, start = PROGRAM_TIMES.compile, time.perf_counter()
    try:
        with env:
            compiled = programs.compile_ahead(method, _abstract_inputs(inputs, mesh))
    except jax.errors.JaxRuntimeError as err:
        vmem = _OUT_OF_VMEM.search(str(err))
        if "RESOURCE_EXHAUSTED" in str(err) and vmem is not None:
            need, limit = (f"{size[:-1]} {size[-1]}iB" for size in vmem.groups())
            raise KernelDoesNotFit(f"needs {need} of scoped VMEM, the limit is {limit}") from None
        found = _OUT_OF_HBM.search(str(err))
        if "RESOURCE_EXHAUSTED" not in str(err) or found is None:
            raise
        required = float(found.group(1)) * _UNITS[found.group(2)]
        available = float(found.group(3)) * _UNITS[found.group(4)]
        seconds = time.perf_counter() - start  # trace and compile: the refusal comes before the compile is timed
        return Compiled(seconds, refused={"required": required, "available": available})
    seconds = PROGRAM_TIMES.compile - compiling
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
    outputs = compiled.out_info[0]  # the program returns (outputs, check flags)
    return Compiled(seconds, memory, float(cost.get("flops", 0.0)), hlo.count_collectives(text), text, None, outputs)


# Stage 2 -------------------------------------------------------------------------------------------


def _per_block(full: dict, two: dict, three: dict, layers: int) -> tuple[dict, dict]:
    """Collectives of one block and of the rest of the program.

    A block's collectives are the difference between the program at three and at two blocks (four and three
    with the interval cache, whose span needs three): measured
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


def base_report(stage: int, target: Target, mesh: Mesh, request, dtype, compiled: Compiled, **fields) -> dict[str, Any]:
    """What every plan reports: where, what, and the compiler's memory verdict (the rest is `fields`)."""
    report: dict[str, Any] = {
        "stage": stage,
        "target": target.name,
        "topology": target.topology,
        "chips": target.chips,
        "devices": target.devices,
        **host_layout(mesh),
        "mesh": dict(mesh.shape),
        "model": request.model_id,
        "video": {"height": request.height, "width": request.width, "num_frames": request.num_frames},
        "dtype": str(dtype).removeprefix("torch."),
        **fields,
        "compile_seconds": round(compiled.seconds, 1),
    }
    if compiled.refused:
        memory = {"total": compiled.refused["required"], "capacity": target.hbm_per_device}
        return {
            **report,
            "fits": False,
            "hbm_bytes_per_device": {**memory, "compiler_limit": compiled.refused["available"]},
        }
    memory = {**compiled.memory, "capacity": target.hbm_per_device}
    return {**report, "fits": memory["total"] <= memory["capacity"], "hbm_bytes_per_device": memory}


def add_flops(report: dict[str, Any], target: Target, xla: float, attention: float = 0.0, int8: bool = False) -> None:
    """FLOPs per device and the step's lower bound at peak bf16; with `int8` (--quantize int8) also the bound
    with XLA's FLOPs (the int8 matmuls among them) at the int8 peak, still a lower bound."""
    report["flops_per_device"] = {"xla": xla, "attention": attention, "total": xla + attention}
    what = report.get("work", STAGE_WORK[report["stage"]])
    report[f"{what}_seconds_lower_bound"] = (xla + attention) / target.bf16_flops_per_device
    if int8:
        bound = xla / target.int8_ops_per_device + attention / target.bf16_flops_per_device
        report[f"{what}_seconds_lower_bound_int8"] = bound


def cache_programs(loop, kind: str, runtime, mesh, rules, inputs, env, expert: int = 0):
    """With a step cache (`kind` magcache or interval): the guided denoiser of `expert` wrapped as a real run
    wraps it, and the (module, rules, inputs) of its full step and of its cached step; else the plain
    denoiser. `rules`: the transformer's rule table."""
    from tpu_video.engine.cache_schedule import CacheSettings
    from tpu_video.engine.cached_blocks import cached_denoiser
    from tpu_video.engine.step_cache import cached_rules, zero_state

    guided = loop.guided[expert]
    if kind == "none":
        return (guided, rules.nested("transformer."), inputs), None
    # The module, its rules and its starting state are built as a run's StepCache builds them.
    module = cached_denoiser(guided, CacheSettings(kind=kind), len(loop.cache_branches), runtime.constrain)
    rules = cached_rules(rules)
    state = zero_state(module, lambda: trace_module(module, rules, inputs, mesh, env, "probe"))
    reuse = (torch.zeros(len(loop.cache_branches), dtype=torch.bool), ())
    return (module, rules, [*state, reuse, *inputs]), (module, rules, [*state, *inputs])


FULL = "full"  # plan_stage2's key for the program at the model's depth


def plan_stage2(
    family,
    source,
    request,
    embeds,
    dtype,
    target: Target,
    attention: AttentionPlan,
    cache="none",
    videos: int = 1,
    scan_blocks: str = "auto",
    store=None,
    quantization: Quantization = NO_QUANTIZATION,
):
    """Compile stage 2's guided denoiser call (what every step runs) for `target`; the report as a dict.

    The program is built by the family's own `denoise_loop`, as a real run builds it, around a
    meta-device transformer, with its blocks under one scan as `scan_blocks` says (tpu_video/engine/scanned_blocks.py).
    It is compiled at the model's depth (memory, FLOPs, every collective) and, unrolled, at two and three
    blocks, whose difference gives the FLOPs, collectives and Splash calls of one block. The compiler counts
    a scanned loop's body once, so a scanned program's counts get the other iterations added from those.
    With a step cache (`cache`: magcache or interval) that is the full step, and the cached step is
    compiled as well. With `videos` > 1 it is stage 2's batch of that many videos (tpu_video/engine/batching.py).
    `store` (an ExecutableStore): the full-depth programs of every expert are saved there, keyed as the run
    on `target` keys them (tpu_video/runtime/program_key.py), for that run to load instead of compiling. `quantization`
    (engine.settings.Quantization) quantizes the blocks' linears as a run does."""
    from splash_attention import record_kernel_calls
    from tpu_video.engine import scanned_blocks
    from tpu_video.engine.batching import batched_loop
    from tpu_video.engine.cache_schedule import CacheSettings
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    mesh, tp_mode = topology_mesh(target, attention.mesh.shape), attention.tp_mode
    runtime = TorchaxRuntime(mesh)  # only its environment and `constrain` are used: nothing is placed
    layers = source.load_config("transformer")["num_layers"]
    compiled, calls = {}, {}
    resident = 0  # bytes per device of the other experts' weights (Wan 2.2), on the device all along
    small = (3, 4) if cache == "interval" else (2, 3)  # the interval cache runs 2 outer blocks around its span
    repeats = 0  # iterations of the full program's scan that the compiler counts once
    for depth in (FULL, *small):  # the model's depth, then (unrolled) the two that give one block
        if depth == layers and not repeats:
            compiled[depth], calls[depth] = compiled[FULL], calls[FULL]  # the same program
            continue
        depth_layers = layers if depth == FULL else depth
        transformers = meta_transformers(family, source, dtype, depth_layers, quantization)
        loops = [family.denoise_loop(source, request, embeds, dtype, transformers, runtime, tp_mode, planning=True)[0]]
        loop = batched_loop(loops * videos) if videos > 1 else loops[0]
        t = loop.timesteps[0]
        inputs = [(loop.model_input(loop.latents, t), ()), (loop.timestep_input(0, t), ()), *loop.static_inputs]
        settings = CacheSettings(kind=cache) if cache != "none" else CacheSettings()
        rules = scanned_blocks.install(loop, scan_blocks if depth == FULL else "off", settings, runtime.scan)
        saving = store if depth == FULL else None
        with runtime.attention(attention), runtime.precision(dtype):
            full_step, cached_step = cache_programs(loop, cache, runtime, mesh, rules, inputs, runtime.env)
            with record_kernel_calls() as traced:
                compiled[depth] = compile_module(*full_step, mesh, runtime.env, store=saving)
        calls[depth] = traced
        if depth == FULL:
            repeats = scanned_blocks.repeated_blocks(loop.guided[0].transformer)
            others = [guided.transformer for guided in loop.guided[1:]]
            facts = weight_facts(others, rules, attention_heads(source))
            resident = facts.weight_bytes(mesh.shape[TP])
            compiled[depth].add_resident(resident)
            with runtime.attention(attention), runtime.precision(dtype):
                if cached_step is not None and not compiled[depth].refused:
                    with record_kernel_calls() as cached_calls:
                        cached = compile_module(*cached_step, mesh, runtime.env, method="cached", store=saving)
                    cached.add_resident(resident)
                if saving is not None and not compiled[depth].refused:
                    _save_other_experts(loop, cache, runtime, mesh, rules, inputs, saving)
        if compiled[depth].refused:
            break
    full = compiled[FULL]
    fields = {"tp_mode": tp_mode, "attention": attention.backend, "experts": len(transformers), "videos": videos}
    report = base_report(2, target, mesh, request, dtype, full, **fields)
    if resident:
        report["hbm_bytes_per_device"]["other_experts_weights"] = resident
    if full.refused:
        return report
    two, three = (compiled[depth] for depth in small)
    per_block, outside = _per_block(full.collectives, two.collectives, three.collectives, layers - repeats)
    total = {
        op: {key: value[key] + repeats * per_block.get(op, {}).get(key, 0) for key in value}
        for op, value in full.collectives.items()
    }
    report["collectives"] = {
        "layers": layers,
        "scanned_blocks": repeats + 1 if repeats else 0,
        "per_block": per_block,
        "outside_blocks": outside,
        "total": {op: value for op, value in total.items() if value["count"]},
    }
    block_calls = calls[small[1]][len(calls[small[0]]) :]  # the third block's Splash calls
    all_calls = calls[FULL] + block_calls * repeats
    xla_flops = full.flops + repeats * (three.flops - two.flops)
    if quantization.enabled:  # read by the matmuls, never dequantized apart
        counts = hlo.quantized_reads(full.hlo_text)
        if repeats:  # the compiler shows the scan's body once: add the other iterations, one block's worth each
            two_reads, three_reads = (hlo.quantized_reads(program.hlo_text) for program in (two, three))
            counts = {key: value + repeats * (three_reads[key] - two_reads[key]) for key, value in counts.items()}
        report["quantize"] = {**quantization.record(), **counts}
    attention_flops = sum(call.flops_per_device for call in all_calls)
    add_flops(report, target, xla_flops, attention_flops, int8=quantization.scheme == "int8")
    report["step_seconds_lower_bound_per_video"] = report["step_seconds_lower_bound"] / videos
    report["splash_custom_calls"] = full.hlo_text.count('custom_call_target="tpu_custom_call"')
    report["splash_padding"] = _padding(all_calls)
    if cache != "none":
        report["step_cache"] = _cached_step_report(cache, target, cached, cached_calls)
        report["fits"] = report["fits"] and report["step_cache"]["fits"]
    if loop.between_plan is not None:  # Wan Animate's VAE between segments
        from tpu_video.planning.between_loops import plan_between_loops

        compiling = functools.partial(compile_module, rules=REPLICATED_TABLE, mesh=mesh, env=runtime.env, store=store)
        report["between_loops"] = plan_between_loops(loop, runtime, target, full, compiling)
        report["fits"] = report["fits"] and report["between_loops"]["fits"]
    return report


def _save_other_experts(loop, cache: str, runtime, mesh, rules, inputs, store) -> None:
    """Compile and save the programs of every expert after the first (Wan 2.2's low-noise transformer): its
    own guidance values make them other programs."""
    for expert in range(1, len(loop.guided)):
        full_step, cached_step = cache_programs(loop, cache, runtime, mesh, rules, inputs, runtime.env, expert)
        compile_module(*full_step, mesh, runtime.env, store=store)
        if cached_step is not None:
            compile_module(*cached_step, mesh, runtime.env, method="cached", store=store)


def _cached_step_report(kind: str, target: Target, cached: Compiled, calls) -> dict[str, Any]:
    """What the cached step needs: its HBM (the compiler's verdict) and FLOPs, like the full step's."""
    report: dict[str, Any] = {"kind": kind, "compile_seconds": round(cached.seconds, 1)}
    if cached.refused:
        memory = {"total": cached.refused["required"], "capacity": target.hbm_per_device}
        return {**report, "fits": False, "hbm_bytes_per_device": memory}
    memory = {**cached.memory, "capacity": target.hbm_per_device}
    attention = sum(call.flops_per_device for call in calls)
    report.update(fits=memory["total"] <= memory["capacity"], hbm_bytes_per_device=memory)
    report["flops_per_device"] = {"xla": cached.flops, "attention": attention, "total": cached.flops + attention}
    report["step_seconds_lower_bound"] = (cached.flops + attention) / target.bf16_flops_per_device
    return report


def plan_stage3(
    family,
    source,
    request,
    dtype,
    target: Target,
    tiling: bool,
    chunk_frames: int | None = None,
    rows: int = 1,
    store=None,
):
    """Compile stage 3's torchax decode (VAE weights replicated, latents split over every device along
    width, else height: engine.decode.latents_split) for `target`, as one program or, with `chunk_frames`,
    as the family's frame programs; the report as a dict. The latents' shape comes from the family's own
    stage-2 loop (built around a one-block meta transformer), so it is the shape stage 2 writes. `rows` > 1
    (benchmarks/vae_split.py): height split `rows` ways and width the rest, on a rows x devices/rows mesh."""
    from sharding import MeshShape
    from tpu_video.engine.decode import LATENTS_GRID_SPLIT, UNEVEN_WIDTH, latents_split
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    mesh = topology_mesh(target, MeshShape(dp=rows, sp=target.devices // rows))
    runtime = TorchaxRuntime(mesh)
    transformers = meta_transformers(family, source, dtype, num_layers=1)
    embeds = family.planning_embeds(source, request, dtype)
    loop, finish = family.denoise_loop(source, request, embeds, dtype, transformers, runtime, "megatron", planning=True)
    tensors, record = finish(loop.latents.to(dtype))
    latents = tensors["latents"]
    vae = meta_module(source, "vae", dtype)
    if tiling:
        vae.enable_tiling()
    decoder = family.Decoder(vae, record["latents_normalization"])
    axis, layout = latents_split(latents.shape, target.devices)  # None: kept whole, as in a real run
    if axis == UNEVEN_WIDTH and not chunk_frames:
        axis = None  # only the frame programs constrain the latents inside
    if rows > 1:
        if latents.shape[-2] % rows or latents.shape[-1] % (target.devices // rows):
            raise ValueError(f"latents {list(latents.shape)} do not split {rows} x {target.devices // rows}")
        axis, layout = f"height x width ({rows} x {target.devices // rows})", LATENTS_GRID_SPLIT
    fields = {"tiling": tiling, "chunk_frames": chunk_frames, "latents": list(latents.shape), "split": axis}
    if family.Soundtrack is not None:  # stage 3 decodes the sound on the host with --backend torchax
        fields["soundtrack"] = {"runs_on": "host", "audio_latents": list(tensors["audio_latents"].shape)}
    if chunk_frames:
        return _plan_frame_programs(
            family, source, decoder, latents, layout, target, mesh, runtime, request, dtype, fields, store
        )
    compiled = compile_module(decoder, REPLICATED_TABLE, [(latents, layout)], mesh, runtime.env, store=store)
    report = base_report(3, target, mesh, request, dtype, compiled, **fields)
    if not compiled.refused:
        report["collectives"] = {"total": {op: v for op, v in compiled.collectives.items() if v["count"]}}
        add_flops(report, target, compiled.flops)
    return report


def _plan_frame_programs(
    family, source, decoder, latents, layout, target, mesh, runtime, request, dtype, fields, store=None
):
    """Stage 3 in frame chunks (the family's frame programs, as `--backend torchax` runs them): each program
    the video calls compiled; memory is the largest program's, the lower bound adds every call."""
    module, inputs, calls = family.frame_plan(source, decoder, latents.shape, runtime, layout, fields["chunk_frames"])
    calls = {name: count for name, count in calls.items() if count}
    compiled = {
        name: compile_module(module, REPLICATED_TABLE, inputs[name], mesh, runtime.env, method=name, store=store)
        for name in calls
    }
    refused = [program for program in compiled.values() if program.refused]
    largest = max(compiled.values(), key=lambda p: p.refused["required"] if p.refused else p.memory["total"])
    fields = {**fields, "programs": list(compiled), "calls": calls}
    report = base_report(3, target, mesh, request, dtype, largest, **fields)
    report["compile_seconds"] = round(sum(program.seconds for program in compiled.values()), 1)
    if not refused:
        report["hbm_bytes_per_program"] = {name: program.memory["total"] for name, program in compiled.items()}
        steady = compiled[list(compiled)[-1]].collectives
        report["collectives"] = {"per_steady_call": {op: v for op, v in steady.items() if v["count"]}}
        report["flops_per_call"] = {name: program.flops for name, program in compiled.items()}
        add_flops(report, target, sum(compiled[name].flops * count for name, count in calls.items()))
    return report
