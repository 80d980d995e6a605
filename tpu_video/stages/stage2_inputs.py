"""Stage 2's inputs for one folder, read and checked before JAX does any work: the request with the flags'
overrides, the model, the stage-1 tensors, the LoRA adapters, the step-cache settings and the checkpoint
guard (with its fingerprint). stage2_run.run builds one per input folder, after checking the flags
that concern several folders (`check_batch_flags`, `batch_resume`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tpu_video import models
from tpu_video.cli import UserError, log, parse_dtype
from tpu_video.cli.folders import hold as hold_folder
from tpu_video.cli.options import with_implied
from tpu_video.engine import batch_folders, lora, passes
from tpu_video.engine.cache_schedule import CacheSettings, check_family_runs, check_window
from tpu_video.engine.guard import DenoiseGuard
from tpu_video.engine.inputs import check_geometry_kept
from tpu_video.models.adapter_origin import likely_model
from tpu_video.runtime.interface import Timer
from tpu_video.stages.feature_flags import cache_settings, lora_flags, quantization, with_mag_ratios
from tpu_video.stages.request import request_flags
from utils import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    STAGE2_FILE,
    Request,
    check_output_dir,
    check_stage1_fresh,
    describe_folder,
    earlier_overrides,
    ensure_writable_dir,
    read_config,
    read_tensors,
)


@dataclasses.dataclass
class ValidatedRun:
    """What stage 2 knows once its inputs are checked (in every process), before JAX does any work."""

    input_dir: Path
    output_dir: Path
    config: dict
    request: Request
    overrides: dict
    source: object
    family: object
    dtype_name: str
    dtype: object  # torch.dtype
    embeddings: dict
    cache: CacheSettings
    adapters: list  # engine.lora.Adapter
    calibrated: tuple  # what MagCache ratios must be calibrated for: model id, adapters, quantization
    guard: DenoiseGuard
    trace_dir: str | None
    timer: Timer
    # A later pass's first latents (the family's loop layout) and what the section records of them
    # (tpu_video/engine/passes.py); None: the denoise starts from noise.
    start_latents: torch.Tensor | None = None
    start_record: dict | None = None
    earlier: dict = dataclasses.field(default_factory=dict)  # utils.earlier_overrides


def validated_run(
    args, processes, input_dir: Path, output_dir: Path, trace_dir: str | None, resume: bool
) -> ValidatedRun:
    """Read and check the flags and one stage-1 folder (every process reads its own copy; only process 0
    prepares the output folder)."""
    timer = Timer()
    if args.warmup_steps < 0:
        raise UserError(f"--warmup_steps {args.warmup_steps} must be >= 0")
    with timer.phase("read"):  # stage 1's files, the model folder's configs (a tiny preset: built), adapters
        if processes.is_main:  # the other processes read beside it; process 0 alone writes
            hold_folder(input_dir, write=output_dir.resolve() == input_dir.resolve())
        config = read_config(input_dir, needs="stage1")
        log(describe_folder(input_dir, config))
        stored = Request.from_config(config, input_dir / CONFIG_FILE)
        flags = {
            **with_implied(models.options_of(stored.model_family), request_flags(args), stored),
            "model_id": args.model,
        }
        size = passes.upsampled_size(Path(args.start_latents)) if args.start_latents else {}
        flags.update({key: value for key, value in size.items() if flags.get(key) is None})  # at their size
        request, overrides = stored.with_overrides(flags)
        check_stage1_fresh(input_dir, config, request)
        if not size:  # a refine from upsampled latents starts from them, not from stage 1's image at its size
            check_geometry_kept(config, overrides)
        source, family = models.resolve_model_for_request(request)
        dtype_name = args.dtype or request.dtype
        dtype = parse_dtype(dtype_name)
        models.validate_request(family, source, request)
        embeddings = read_tensors(input_dir, config["stage1"])
        if processes.is_main:
            hold_folder(output_dir, write=True)  # an existing output folder, before it is checked
        check_output_dir(output_dir, input_dir, config)
        start = None
        if args.start_latents:
            start = passes.read_start(Path(args.start_latents), request, output_dir, models.stage1_only(family))
        models.check_started(family, request, start is not None)
        models.check_option_inputs(family, request, config["stage1"].get("inputs", {}))
        start_latents = family.start_from(source, request, start.tensors, embeddings) if start else None
        stage1 = config["stage1"].get("adapters", [])
        adapters = lora.read_adapters(lora_flags(args), family, source, dtype, stage1, likely_model=likely_model)
    quantize = quantization(args)
    calibrated = (request.model_id, lora.identity(adapters), quantize.calibration_key())
    cache = cache_settings(args)
    check_family_runs(family, cache)
    cache = with_mag_ratios(cache, args, input_dir, *calibrated)
    steps = family.denoise_steps(source, request, config["stage1"].get("task", "t2v"))
    check_window(cache, steps)  # the steps the loop will run, before weights load
    quantize.check_supported()
    if processes.is_main:
        ensure_writable_dir(output_dir, (STAGE2_FILE,))
    fingerprint = {**request.fingerprint(models.stage1_only(family)), "dtype": dtype_name}
    fingerprint["stage1_sha256"] = config["stage1"]["sha256"]
    fingerprint.update({"cache": cache.record(), **({"adapters": lora.identity(adapters)} if adapters else {})})
    if quantize.enabled:  # a checkpoint of another scheme or layer set cannot be resumed
        fingerprint["quantize"] = quantize.record()
    if start is not None:  # a checkpoint of a pass from other latents cannot be resumed
        fingerprint["start_latents"] = start.record["sha256"]
    guard = DenoiseGuard(
        output_dir,
        fingerprint,
        every=args.checkpoint_every,
        resume=resume,
        processes=processes,
    )
    return ValidatedRun(
        input_dir,
        output_dir,
        config,
        request,
        overrides,
        source,
        family,
        dtype_name,
        dtype,
        embeddings,
        cache,
        adapters,
        calibrated,
        guard,
        trace_dir,
        timer,
        start_latents,
        start.record if start else None,
        earlier_overrides(config, request, overrides),
    )


def check_batch_flags(args, folders: list[Path]) -> None:
    """Flags that cannot apply to several folders, or to a batch of several videos, refused up front."""
    if len(folders) > 1 and args.output_dir:
        raise UserError("--output_dir names one folder; with several input folders each writes into its own")
    if len(folders) > 1 and args.start_latents:
        raise UserError("--start_latents names one folder's latents: give one --input_dir (a pass per video)")
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size} must be >= 1")
    if (args.batch_size or 1) > 1 and cache_settings(args).kind == "magcache":
        what = "--cache_calibrate" if args.cache_calibrate else "--cache magcache"
        raise UserError(
            f"{what} with --batch_size {args.batch_size}: MagCache decides from each video's own data, so it "
            "runs one video per batch; use --batch_size 1 (the interval cache batches)"
        )


def batch_resume(args, folders: list[Path]) -> list[tuple[Path, bool]]:
    """The folders to denoise and whether each resumes. One folder: as given. Several with --resume: a
    folder with a checkpoint resumes, one already denoised (its latents fresh, no checkpoint) is skipped,
    any other starts over."""
    if len(folders) == 1 or not args.resume:
        return [(folder, args.resume) for folder in folders]
    todo = []
    for folder in folders:
        if (folder / CHECKPOINT_FILE).is_file():
            todo.append((folder, True))
        elif batch_folders.denoised(folder):
            log(f"--resume: {folder} is denoised already; skipped")
        else:
            todo.append((folder, False))
    return todo
