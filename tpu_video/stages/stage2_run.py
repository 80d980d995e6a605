"""Stage 2 for parsed flags (`run`; `plan_main` for --plan): its folders read and checked
(stages.stage2_inputs), the runtime, mesh and attention for one folder or a group of batches
(`runtime_for`), the denoise of one folder (`denoise_and_write`) or of several in groups and batches
(`denoise_batches`), and the stage-2 section each folder gets (`write_section`)."""

from __future__ import annotations

import functools
import types
from pathlib import Path

from tpu_video import models
from tpu_video.cli import UserError, log, parse_dtype, refuse_planning_flags, set_logging
from tpu_video.engine import batch_folders, lora, segments
from tpu_video.engine.batching import default_batch_size, denoise_group, group_key
from tpu_video.engine.cache_schedule import check_family_runs
from tpu_video.engine.denoise import DenoiseOptions, denoise
from tpu_video.engine.guard import sigterm_sets_stop
from tpu_video.engine.meta import model_facts
from tpu_video.models.adapter_origin import likely_model
from tpu_video.runtime import distributed
from tpu_video.runtime.interface import run_record
from tpu_video.stages.feature_flags import cache_settings, lora_flags, quantization
from tpu_video.stages.request import request_flags
from tpu_video.stages.stage2_attention import attention_flags, attention_plan, where_it_fits
from tpu_video.stages.stage2_flags import profile_dir
from tpu_video.stages.stage2_inputs import ValidatedRun, batch_resume, check_batch_flags, validated_run
from tpu_video.stages.stage2_upsample import given_upsample_flags, upsample_main
from utils import DEFAULT_OUTPUT_DIR, STAGE2_FILE, sections_for_output, write_stage_config, write_tensors


def runtime_for(args, run, processes, videos: int = 1):
    """The attention plan (its mesh for a batch of `videos`), runtime, SDPA override, loop options and their
    record: what one folder's denoise and a group of batches set up alike."""
    import jax

    from tpu_video.planning import tpus
    from tpu_video.runtime import placement
    from tpu_video.runtime.torchax_runtime import CompileCache, TorchaxRuntime, device_memory

    platform, kind = jax.devices()[0].platform, jax.devices()[0].device_kind
    generation = tpus.generation_of(kind) if platform == "tpu" else None
    if platform == "tpu" and generation is None:
        log(f"unknown TPU generation {kind!r}: Splash tiles are not capped")
    per_host = jax.local_device_count() if processes.count > 1 else None
    run_model = (run.family, run.source, run.request, run.dtype)
    plan = attention_plan(args, run_model, platform, jax.device_count(), per_host, device_memory(), generation, videos)
    compile_cache = CompileCache(enabled=not args.no_compile_cache)
    mesh = placement.make_mesh(plan.mesh.shape)
    runtime = TorchaxRuntime(mesh, profile_dir=run.trace_dir, compile_cache=compile_cache, executables=args.executables)
    hosts = f", {processes.count} processes" if processes.count > 1 else ""
    described = f"{runtime.describe()}{hosts}, {run.dtype_name}, attention {plan.backend} ({plan.backend_why})"
    log(f"{run.family.NAME} transformer, {described}")
    fuse = functools.partial(lora.fuse, adapters=run.adapters, family=run.family) if run.adapters else None
    quantize = quantization(args)
    loop_flags = (plan.tp_mode, args.warmup_steps, run.guard, run.cache, args.scan_blocks)
    options = DenoiseOptions(*loop_flags, on_loaded=fuse, quantization=quantize)
    backend = runtime.attention(plan)
    return runtime, backend, options, {**plan.record(), "processes": processes.count, "quantize": quantize.record()}


def changes(overrides: dict[str, list]) -> str:
    """{"seed": [42, 7]} as `seed 42 -> 7`, for the log (the config keeps the pairs)."""
    return ", ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in overrides.items())


def denoise_and_write(args, run: ValidatedRun, processes) -> None:
    """Place, compile and run the loop on the mesh; process 0 writes the latents and the config section."""
    runtime, backend, options, record = runtime_for(args, run, processes)
    log(f"request overrides: {changes(run.overrides) or 'none'}")
    if run.earlier:
        log(f"kept from an earlier run's overrides (stage 1's value -> now): {changes(run.earlier)}")
    with backend, runtime.precision(run.dtype), run.guard.stop_handler():
        tensors, info, step_cache = denoise(
            run.family,
            run.source,
            run.request,
            run.embeddings,
            run.dtype,
            runtime,
            run.timer,
            options,
            run.start_latents,
        )
    if not processes.is_main:
        processes.agree("written", None)  # wait for process 0's files, and fail if it failed
        return
    with run.timer.phase("save"):
        saved = write_tensors(run.output_dir / STAGE2_FILE, tensors)
        if args.cache_calibrate:
            step_cache.write_ratios(run.output_dir, *run.calibrated)
    run.timer.finish()
    if step_cache is not None:
        record["step_cache"] = {**step_cache.record(), **run.timer.median_steps()}
    write_section(args, run, saved, tensors, info, run.timer, record, runtime)
    run.guard.finished()
    processes.agree("written", None)


def denoise_batches(args, runs: list[ValidatedRun], processes) -> None:
    """Several folders: grouped by what the compiled program and schedule depend on (in list order), each
    group denoised in batches of --batch_size sharing one placement and program (tpu_video/engine/batching.py)."""
    import jax

    from tpu_video.runtime.torchax_runtime import device_memory

    groups: dict[tuple, list[ValidatedRun]] = {}
    for run in runs:
        task = run.config["stage1"].get("task", "t2v")
        groups.setdefault(
            (group_key(run.request, run.family.OPTIONS, task, run.cache.record(), run.embeddings), run.dtype_name), []
        ).append(run)
    stop = types.SimpleNamespace(stop_requested=False)
    per_host, memory = jax.local_device_count() if processes.count > 1 else None, device_memory()
    mesh_flags = attention_flags(args)
    for number, members in enumerate(groups.values(), 1):
        first = members[0]
        log(f"group {number} of {len(groups)}: {len(members)} video(s)")
        size = args.batch_size or default_batch_size(
            first, mesh_flags, len(members), jax.device_count(), per_host, memory
        )
        stopped_in = {run.guard.resumed_batch_size for run in members if run.guard.restored is not None}
        if len(stopped_in) == 1 and stopped_in != {size}:  # the same program, so the same latents to the bit
            (size,) = stopped_in
            log(f"--resume: this group's videos were stopped in batches of {size}; they resume in them")
        elif not stopped_in and size > len(members):  # a batch padded with copies would only repeat work
            log(f"--batch_size {size}: this group has {len(members)} video(s), so batches of {len(members)}")
            size = len(members)
        runtime, backend, options, record = runtime_for(args, first, processes, size)
        by_start: dict[tuple, list[ValidatedRun]] = {}  # videos stopped after the same step batch together
        for run in members:  # and in the same of their loops (Wan Animate's segments)
            by_start.setdefault((segments.position(run.guard), run.guard.start_step), []).append(run)
        batches = [same[i : i + size] for same in by_start.values() for i in range(0, len(same), size)]

        def write(run, tensors, info, timer, timing, batch, step_cache, record=record, group=number, runtime=runtime):
            timer.seconds = timing  # the batch's table, finished once
            saved = write_tensors(run.output_dir / STAGE2_FILE, tensors)
            record = {**record, "batch": {"group": group, **batch}}
            if step_cache is not None:
                record["step_cache"] = step_cache
            write_section(args, run, saved, tensors, info, timer, record, runtime)

        with backend, runtime.precision(first.dtype), sigterm_sets_stop(stop):
            denoise_group(first.family, first.source, batches, size, first.dtype, runtime, options, stop, write)


def write_section(args, run: ValidatedRun, saved: dict, tensors, info, timer, record: dict, runtime) -> None:
    """Write one folder's stage2 section (process 0), once its tensors (`latents`, ...) are `saved`."""
    step_cache = {"step_cache": record.pop("step_cache")} if "step_cache" in record else {}
    section = {
        **saved,
        "stage1_sha256": run.config["stage1"]["sha256"],
        "request": run.request.fingerprint(models.stage1_only(run.family)),
        "resumed": run.guard.restored is not None,
        **info,
        **record,
        "overrides": run.overrides,
        **({"earlier_overrides": run.earlier} if run.earlier else {}),
        **({"start_latents": run.start_record} if run.start_record else {}),
        **({"adapters": [adapter.record() for adapter in run.adapters]} if run.adapters else {}),
        "warmup_steps": args.warmup_steps,
        "step_seconds": timer.step_seconds,
        **step_cache,
        **run_record(runtime, run.dtype_name, timer.seconds, ("diffusers",)),
    }
    sections = sections_for_output(run.config, run.input_dir, run.output_dir)
    write_stage_config(run.output_dir, run.request, sections, "stage2", section)
    layouts = {name: info.get(f"{name}_layout", "") for name in tensors}  # latents_layout, audio_latents_layout
    shapes = ", ".join(f"{name} {tuple(tensor.shape)} {layouts[name]}".rstrip() for name, tensor in tensors.items())
    log(f"wrote {run.output_dir / STAGE2_FILE}: {shapes}")


def plan_main(args) -> None:
    """--plan: compile for a TPU slice, print the report, exit 0 (fits) or 3 (does not fit)."""
    from tpu_video.planning import flags, plan
    from tpu_video.planning import report as plan_report

    target = flags.target_from_flag(args.plan)
    store = flags.executables_to_save(args.save_executables, target)
    if args.start_latents:
        log("--start_latents: a pass from given latents runs the same programs as one from noise")
    request, source, family, embeddings = flags.request_to_plan(
        flags.plan_folder(args.input_dir, args.model), args.model, request_flags(args), args.dtype
    )
    dtype = parse_dtype(args.dtype or request.dtype)
    cache = cache_settings(args)
    check_family_runs(family, cache)
    adapters = lora.read_adapters(lora_flags(args), family, source, dtype, likely_model=likely_model)
    target_devices = (target.devices, target.devices_per_host, target.hbm_per_device)
    attention = attention_plan(
        args, (family, source, request, dtype), "tpu", *target_devices, target.generation, args.batch_size or 1
    )
    log(f"planning {family.NAME} stage 2 for {target.name} ({target.topology}), mesh {attention.mesh.shape}")
    try:
        report = plan.plan_stage2(
            family,
            source,
            request,
            embeddings,
            dtype,
            target,
            attention,
            cache.kind,
            args.batch_size or 1,
            args.scan_blocks,
            store,
            quantization(args),
        )
    except plan.KernelDoesNotFit as err:
        splash = attention.splash
        tiles = f"{splash.block_q}/{splash.block_kv}/{splash.block_kv_compute}"
        raise UserError(
            f"--plan {args.plan}: Splash with tiles {tiles} (block_q/block_kv/block_kv_compute) {err} on "
            f"{target.generation.prefix}; use smaller tiles, e.g. --block_q 1024 --block_kv 1024 --block_kv_compute 512"
        ) from None
    report["mesh_choice"] = attention.mesh.record()
    if not report["fits"]:
        facts = model_facts(family, source, dtype, args.tp_mode, request, quantization(args))
        branches = family.guidance_branches(source, request)
        videos, mesh = args.batch_size or 1, attention.mesh.shape
        report["where_it_fits"] = where_it_fits(facts, branches, videos, *target_devices, target.generation, mesh)
    if adapters:
        report["adapters"] = {"fused": [a.record() for a in adapters], "effect": lora.PLAN_EFFECT}
    plan_report.finish(report, args.plan_json, store)


def run(args) -> None:
    """Stage 2 for parsed flags (stage2_flags.build_parser): the script's main and the Python API call it."""
    if args.upsample:
        return upsample_main(args)
    if given_upsample_flags(args):
        raise UserError(f"{given_upsample_flags(args)[0]} acts only with --upsample")
    if args.plan:
        if args.resume:
            raise UserError("--resume continues a denoise from its checkpoint; --plan runs none (give one of them)")
        check_batch_flags(args, [])
        return plan_main(args)
    refuse_planning_flags(args)
    if args.peer_timeout <= 0:
        raise UserError(f"--peer_timeout {args.peer_timeout} must be a positive number of seconds")
    folders = batch_folders.expand_folders(args.input_dir or [DEFAULT_OUTPUT_DIR])
    check_batch_flags(args, folders)
    settings = distributed.launch_settings(args.coordinator_address, args.num_processes, args.process_id)
    # Several processes: JAX's distributed runtime starts first, so they can agree on their inputs.
    processes = distributed.Processes.start(settings, args.peer_timeout)
    set_logging(processes.is_main)
    if len(folders) > 1 and processes.count > 1:
        raise UserError("several input folders run in one process for now; give each multi-host run one folder")
    trace_dir = profile_dir(args)
    with processes.agreeing("inputs"):
        runs = [
            validated_run(args, processes, folder, Path(args.output_dir or folder), trace_dir, resume)
            for folder, resume in batch_resume(args, folders)
        ]
    for run in runs:
        run.guard.share_restored()
    with processes.failures_shared():
        if len(folders) == 1:
            denoise_and_write(args, runs[0], processes)
        else:
            denoise_batches(args, runs, processes)
    processes.finish()
