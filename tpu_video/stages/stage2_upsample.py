"""Stage 2's `--upsample`: the step between two passes (LTX-2's x2 latent upsampler) as a stage folder of its own.
The input folder's stage-2 latents are read and checked, the family's upsampler runs on every device (weights
replicated, one program, the latents split where the family splits them), and the output folder gets the
upsampled latents with the request at the new size: the next pass takes it as `--start_latents`, stage 3 can
decode it, and rerunning the step redoes nothing else. `--plan` compiles the step for a TPU instead."""

from __future__ import annotations

from pathlib import Path

from sharding import SP
from tpu_video import models
from tpu_video.cli import UserError, log, refuse_planning_flags
from tpu_video.cli.folders import hold as hold_folder
from tpu_video.engine import batch_folders
from tpu_video.runtime.interface import Timer, run_record
from tpu_video.stages.request import request_flags
from utils import (
    CONFIG_FILE,
    DEFAULT_OUTPUT_DIR,
    STAGE2_FILE,
    Request,
    check_output_dir,
    check_stage2_fresh,
    describe_folder,
    ensure_writable_dir,
    read_config,
    read_tensors,
    sections_for_output,
    write_stage_config,
    write_tensors,
)

UPSAMPLE_ONLY = ("--latent_upsampler", "--adain_factor", "--tone_map_compression_ratio")


def given_upsample_flags(args) -> list[str]:
    values = (args.latent_upsampler, args.adain_factor, args.tone_map_compression_ratio)
    return [flag for flag, value in zip(UPSAMPLE_ONLY, values, strict=True) if value]


def check_flags(args, folders: list[Path]) -> None:
    """What a denoise takes and the step does not, refused up front (the request's flags belong to the pass
    after it; a plan's `--model` and request flags name the first pass), and the filters' ranges."""
    check_filters(args)
    if len(folders) != 1:
        raise UserError("--upsample: give one --input_dir (the pass whose latents it upsamples)")
    if not args.output_dir or Path(args.output_dir).resolve() == folders[0].resolve():
        raise UserError(
            "--upsample writes a folder of its own (the input's latents stay, for a rerun): give --output_dir"
        )


def check_filters(args, planning: bool = False) -> None:
    denoise_only = {
        "--start_latents": args.start_latents,
        "--resume": args.resume,
        "--checkpoint_every": args.checkpoint_every,
        "--lora": args.lora or args.lora_2,
        "--cache": args.cache != "none" or args.enable_cache or args.cache_calibrate,
        "--quantize": args.quantize != "none",
        "--batch_size": args.batch_size,
        "--plan": args.plan and not planning,
        "--model": args.model and not planning,
        "--dtype": args.dtype,
        "--attention": args.attention != "auto",
        "--dp/--sp/--tp": args.dp or args.sp or args.tp,
        "--profile": args.profile or args.enable_profiler,
        "--num_processes": args.num_processes,
    }
    given = [flag for flag, value in denoise_only.items() if value]  # each one's default is falsy
    if not planning:
        given += [f"--{name}" for name, value in request_flags(args).items() if value is not None]
    if given:
        raise UserError(
            f"--upsample runs the latent upsampler alone; {given[0]} belongs to a denoise (give it to the pass "
            "after it)"
        )
    if not planning:
        refuse_planning_flags(args)
    if not -10.0 <= args.adain_factor <= 10.0:
        raise UserError(f"--adain_factor {args.adain_factor} must be from -10 to 10 (the pipeline's range; 0: off)")
    if not 0.0 <= args.tone_map_compression_ratio <= 1.0:
        raise UserError(f"--tone_map_compression_ratio {args.tone_map_compression_ratio} must be from 0 (off) to 1")


def upsample_plan(args) -> None:
    """--upsample --plan TPU: the step compiled for a TPU slice, for the first pass of --input_dir (its stage-1
    request) or of --model with --height, --width and --num_frames; the report printed (and saved with --plan_json),
    exit 0 (fits) or 3. Writes nothing else."""
    from tpu_video.planning import flags
    from tpu_video.planning import report as plan_report
    from tpu_video.planning.upsample import plan_upsample_step

    check_filters(args, planning=True)
    if args.save_executables:
        raise UserError("--upsample --plan: --save_executables is not supported for the step (its key is unchecked)")
    target = flags.target_from_flag(args.plan)
    folders = batch_folders.expand_folders(args.input_dir) if args.input_dir else []
    if len(folders) > 1:
        raise UserError("--upsample: give one --input_dir (the pass whose latents it upsamples)")
    given = {name: value for name, value in request_flags(args).items() if value is not None}
    extra = sorted(set(given) - (set() if folders else {"height", "width", "num_frames"}))
    if extra:
        raise UserError(
            f"--upsample --plan: --{extra[0]} does not apply; the step takes the first pass's size from --input_dir, "
            "or from --model with --height, --width and --num_frames"
        )
    folder = folders[0] if folders else flags.plan_folder(None, args.model)
    request, source, family = flags.planned_request(folder, args.model, given, args.dtype)
    upsampled_request(family, source, request)  # the refine's size, checked as the step checks it
    filters = (args.adain_factor, args.tone_map_compression_ratio)
    log(f"planning {family.NAME}'s --upsample for {target.name} ({target.topology}), every device on sp")
    report = plan_upsample_step(family, source, request, args.latent_upsampler, filters, target)
    plan_report.finish(report, args.plan_json)


def upsampled_request(family, source, request: Request):
    """The request at the x2 upsampler's size (the family's checks refuse any other scale), checked as a pass at
    that size is; with the overrides the section records."""
    larger, overrides = request.with_overrides({"height": request.height * 2, "width": request.width * 2})
    models.validate_request(family, source, larger)
    return larger, overrides


def upsample_main(args) -> None:
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    if args.plan:
        return upsample_plan(args)

    folders = batch_folders.expand_folders(args.input_dir or [DEFAULT_OUTPUT_DIR])
    check_flags(args, folders)
    input_dir, output_dir = folders[0], Path(args.output_dir)
    hold_folder(input_dir, write=False)
    config = read_config(input_dir, needs="stage2")
    log(describe_folder(input_dir, config))
    request = Request.from_config(config, input_dir / CONFIG_FILE)
    source, family = models.resolve_model_for_request(request)
    check_stage2_fresh(input_dir, config, request, models.stage1_only(family))
    tensors = read_tensors(input_dir, config["stage2"])
    hold_folder(output_dir, write=True)  # an existing output folder, before it is checked
    check_output_dir(output_dir, input_dir, config)
    larger, overrides = upsampled_request(family, source, request)
    timer = Timer()
    runtime = TorchaxRuntime.on_all_devices(SP, compile_cache=not args.no_compile_cache, executables=args.executables)
    filters = (args.adain_factor, args.tone_map_compression_ratio)
    upsampled, scale, record = family.upsample(source, args.latent_upsampler, tensors, runtime, timer, *filters)
    ensure_writable_dir(output_dir, (STAGE2_FILE,))
    with timer.phase("save"):
        saved = write_tensors(output_dir / STAGE2_FILE, upsampled)
    timer.finish()
    earlier = config["stage2"]
    kept = {key: value for key, value in earlier.items() if key == "latents_normalization" or key.endswith("_layout")}
    section = {
        **saved,
        "stage1_sha256": config["stage1"]["sha256"],
        "request": larger.fingerprint(models.stage1_only(family)),
        **kept,
        "upsampled": {"file": earlier["file"], "sha256": earlier["sha256"], "scale": scale, **record},
        "overrides": overrides,
        **run_record(runtime, "fp32", timer.seconds, ("diffusers",)),
    }
    write_stage_config(output_dir, larger, sections_for_output(config, input_dir, output_dir), "stage2", section)
    shapes = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in upsampled.items())
    log(f"wrote {output_dir / STAGE2_FILE}: {shapes} ({larger.height}x{larger.width})")
