#!/usr/bin/env python
"""Stage 2: denoise with the stock diffusers transformer running on a JAX device through torchax.

Reads stage1_embeddings.safetensors + generation_config.json, shards the transformer over a dp/sp/tp
mesh, runs the family's scheduler loop with classifier-free guidance (latents checked for NaN/Inf after
every step; checkpoints with --checkpoint_every and on SIGTERM, continued with --resume), and writes
stage2_latents.safetensors (tensor `latents`, layout B,C,F,H,W, normalised as the transformer sees them:
the section's `latents_normalization` says how; LTX-2 adds `audio_latents`) plus a `stage2` section in the config.
"""

from __future__ import annotations

import argparse
import functools
import types
from pathlib import Path

from tpu_video import models
from tpu_video.attention.plan import SP_MODES
from tpu_video.cli import (
    UserError,
    add_executables_argument,
    add_plan_arguments,
    dtype_flag,
    flag_names,
    log,
    parse_dtype,
    refuse_planning_flags,
    run_cli,
    set_logging,
    stage_parser,
)
from tpu_video.engine import batch_folders, lora, quantize
from tpu_video.engine.batching import default_batch_size, denoise_group, group_key
from tpu_video.engine.cache_schedule import add_cache_arguments, check_family_runs, kind_from_flags
from tpu_video.engine.denoise import DenoiseOptions, denoise
from tpu_video.engine.guard import sigterm_sets_stop
from tpu_video.engine.meta import model_facts
from tpu_video.engine.scanned_blocks import add_scan_argument
from tpu_video.models.adapter_origin import likely_model
from tpu_video.runtime import distributed
from tpu_video.runtime.interface import run_record
from tpu_video.stages.request import add_request_arguments, request_flags
from tpu_video.stages.stage2_attention import attention_plan, where_it_fits
from tpu_video.stages.stage2_inputs import (
    PROFILE_DIR,
    ValidatedRun,
    batch_resume,
    check_batch_flags,
    profile_dir,
    validated_run,
)
from tpu_video.workarounds.warning_filters import filter_harmless_warnings
from utils import (
    CHECKPOINT_FILE,
    DEFAULT_OUTPUT_DIR,
    STAGE2_FILE,
    stage_sections,
    write_stage_config,
    write_tensors,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = stage_parser(__file__, __doc__)
    parser.add_argument(
        "--input_dir",
        nargs="+",
        help=f"folder(s) with stage 1's files, or a batch folder (its batch.json) (default: {DEFAULT_OUTPUT_DIR}; "
        "with --plan and --model: none, the plan is made from the model and the request flags)",
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        help="several folders: videos per batch, those of a group sharing one compiled program (default: the "
        "largest part of the group whose default mesh gives each device one sample (a video's CFG branch) with "
        "the weights within their share of memory; 1 with --cache magcache)",
    )
    parser.add_argument("--output_dir", help="where to write the latents and config (default: --input_dir)")
    parser.add_argument(
        "--start_latents",
        metavar="FOLDER",
        help="a later pass: start from FOLDER's stage-2 latents where the denoise would draw its initial noise, as "
        "the pipeline called with latents= (same model family, size and frame count; write it to its own "
        "--output_dir; Wan; docs/usage.md#a-second-pass)",
    )
    parser.add_argument(
        *flag_names("--model"), dest="model", help="override the model recorded by stage 1 (same family only)"
    )
    parser.add_argument(
        "--dtype", type=dtype_flag, help="bf16, fp16 or fp32 (or float32, ...) for the transformer (default: stage 1's)"
    )
    attention = parser.add_argument_group("attention")
    attention.add_argument(
        "--attention",
        choices=("auto", "splash", "xla", "cudnn"),
        default="auto",
        help="splash: the Pallas Splash kernel (Pallas interpret mode off TPU); cudnn: JAX's cuDNN fused "
        "attention (NVIDIA GPU, bf16/fp16); xla: plain XLA softmax attention (tpu_video/attention/xla.py); "
        "auto: Splash on TPU, cuDNN on a GPU (XLA in fp32), else xla (default: auto)",
    )
    for name in ("block_q", "block_kv", "block_kv_compute"):
        attention.add_argument(f"--{name}", type=int, help="Splash tile size, a multiple of 128 (default: per family)")
    attention.add_argument(
        "--local_window", type=int, help="Splash: each token attends to tokens within this distance (default: off)"
    )
    attention.add_argument(
        "--k_smoothing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Splash: subtract the mean of the valid keys (exact; centres scores for bf16) (default: off)",
    )
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument(
        "--warmup_steps",
        type=int,
        default=2,
        help="denoiser calls before the timed loop, to build its programs; results discarded (default: %(default)s)",
    )
    runtime.add_argument(
        "--no_compile_cache",
        action="store_true",
        help="do not use the persistent JAX compilation cache (folder: $JAX_COMPILATION_CACHE_DIR, "
        "else ~/.cache/tpu-video/jax-compilation-cache)",
    )
    add_executables_argument(runtime)
    add_scan_argument(runtime)
    runtime.add_argument(
        "--checkpoint_every",
        type=int,
        default=0,
        metavar="N",
        help=f"save the loop state to {CHECKPOINT_FILE} every N steps (SIGTERM always saves one) (default: off)",
    )
    runtime.add_argument(
        "--resume", action="store_true", help=f"continue from {CHECKPOINT_FILE} in --output_dir (same request)"
    )
    runtime.add_argument("--profile", metavar="DIR", help="write a JAX profiler trace of the first 3 timed steps")
    runtime.add_argument(
        "--enable_profiler",
        action="store_true",
        help=f"the reference scripts' spelling of --profile: trace into --profiler_output_dir (default: {PROFILE_DIR})",
    )
    runtime.add_argument("--profiler_output_dir", metavar="DIR", help="with --enable_profiler: where the trace goes")
    add_cache_arguments(parser)
    lora.add_arguments(parser)
    quantize.add_arguments(parser)
    mesh = parser.add_argument_group(
        "device mesh (product must equal the device count; unset axes are chosen and logged, docs/sharding.md)"
    )
    mesh.add_argument(
        "--dp",
        type=int,
        help="data parallel: the CFG branches (default: 2 with CFG where the weights still fit, else 1)",
    )
    mesh.add_argument(
        "--sp", type=int, help="sequence parallel: the video tokens split between blocks (default: the rest)"
    )
    mesh.add_argument(
        "--sp_mode",
        choices=SP_MODES,
        default="auto",
        help="attention over the split sequence. ulysses: all-to-alls trade the sequence split for a head "
        "split (needs the heads per tp shard to divide by sp); ring: key/value chunks pass round the sp devices "
        "(any head count, no --local_window); gather: queries stay split and every device gathers all keys "
        "and values; auto: ulysses where the heads allow, else ring (gather with --local_window) "
        "(default: %(default)s)",
    )
    mesh.add_argument(
        "--tp", type=int, help="tensor parallel: heads and MLP columns (default: the most the heads allow in one host)"
    )
    mesh.add_argument(
        "--tp_mode",
        choices=("megatron", "replicated_out"),
        default="megatron",
        help="megatron: attention-out and MLP-out row-parallel; replicated_out: those stay replicated "
        "(more memory; see docs/sharding.md) (default: %(default)s)",
    )
    distributed.add_arguments(parser)
    compiles = "this run's denoiser (its collectives, FLOPs and Splash padding reported too)"
    add_plan_arguments(parser, compiles, ". Without stage-1 files, plans from --model and the request flags")
    add_request_arguments(parser, for_later_stage=True)
    return parser.parse_args(argv)


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
    check_family_runs(family, args)
    adapters = lora.read_adapters(args, family, source, dtype, likely_model=likely_model)
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
            kind_from_flags(args),
            args.batch_size or 1,
            args.scan_blocks,
            store,
            quantize.Quantization.from_args(args),
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
        facts = model_facts(family, source, dtype, args.tp_mode, request, quantize.Quantization.from_args(args))
        branches = family.guidance_branches(source, request)
        videos, mesh = args.batch_size or 1, attention.mesh.shape
        report["where_it_fits"] = where_it_fits(facts, branches, videos, *target_devices, target.generation, mesh)
    if adapters:
        report["adapters"] = {"fused": [a.record() for a in adapters], "effect": lora.PLAN_EFFECT}
    plan_report.finish(report, args.plan_json, store)


def main(argv=None) -> None:
    args = parse_args(argv)
    filter_harmless_warnings()
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
    quantization = quantize.Quantization.from_args(args)
    loop_flags = (plan.tp_mode, args.warmup_steps, run.guard, run.cache, args.scan_blocks)
    options = DenoiseOptions(*loop_flags, on_loaded=fuse, quantization=quantization)
    backend = runtime.attention(plan)
    return runtime, backend, options, {**plan.record(), "processes": processes.count, "quantize": quantization.record()}


def denoise_and_write(args, run: ValidatedRun, processes) -> None:
    """Place, compile and run the loop on the mesh; process 0 writes the latents and the config section."""
    runtime, backend, options, record = runtime_for(args, run, processes)
    log(f"request overrides: {run.overrides or 'none'}")
    if run.earlier:
        log(f"kept from earlier overrides ([stage 1's, now]): {run.earlier}")
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
            (group_key(run.request, run.family.OPTIONS, task, run.cache.record()), run.dtype_name), []
        ).append(run)
    stop = types.SimpleNamespace(stop_requested=False)
    per_host, memory = jax.local_device_count() if processes.count > 1 else None, device_memory()
    for number, members in enumerate(groups.values(), 1):
        first = members[0]
        log(f"group {number} of {len(groups)}: {len(members)} video(s)")
        size = args.batch_size or default_batch_size(args, first, len(members), jax.device_count(), per_host, memory)
        stopped_in = {run.guard.resumed_batch_size for run in members if run.guard.restored is not None}
        if len(stopped_in) == 1 and stopped_in != {size}:  # the same program, so the same latents to the bit
            (size,) = stopped_in
            log(f"--resume: this group's videos were stopped in batches of {size}; they resume in them")
        elif not stopped_in and size > len(members):  # a batch padded with copies would only repeat work
            log(f"--batch_size {size}: this group has {len(members)} video(s), so batches of {len(members)}")
            size = len(members)
        runtime, backend, options, record = runtime_for(args, first, processes, size)
        by_start: dict[int, list[ValidatedRun]] = {}  # videos stopped after the same step batch together
        for run in members:
            by_start.setdefault(run.guard.start_step, []).append(run)
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
    write_stage_config(run.output_dir, run.request, stage_sections(run.config), "stage2", section)
    shapes = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in tensors.items())
    log(f"wrote {run.output_dir / STAGE2_FILE}: {shapes} ({info['latents_layout']})")


def cli() -> None:
    """The installed command (pyproject.toml's scripts): main() under the CLI conventions, as below."""
    run_cli(main)


if __name__ == "__main__":
    cli()
