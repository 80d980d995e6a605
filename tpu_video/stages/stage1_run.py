"""Stage 1 for parsed flags (`run`; `plan_main` for --plan): one video's request and media inputs read and
checked before any weights load (`checked_video`, for each entry of a list), and its prompts and inputs
encoded and its folder written as a single run writes it (`encode_and_write`), keeping a later stage's
sections (`utils.later_sections`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from sharding import TP
from tpu_video import models
from tpu_video.cli import UserError, log, parse_dtype, refuse_planning_flags
from tpu_video.engine import batch_folders, inputs, lora_stage1
from tpu_video.runtime.backend import check_backend_flags, open_runtime
from tpu_video.runtime.interface import Timer, run_record
from tpu_video.stages.request import media_flags, request_from_flags
from utils import (
    STAGE1_FILE,
    Request,
    ensure_writable_dir,
    later_sections,
    write_stage_config,
    write_tensors,
)

DEFAULT_SEED = 42


@dataclasses.dataclass
class Video:
    """One video's stage-1 work, checked: its folder, request and media inputs (by name; `task` and
    `records` as the stage-1 section records them)."""

    output_dir: Path
    request: Request
    inputs: dict
    records: dict
    task: str
    # The checkpoint picks the length from the prompt (family.frames_from_prompt), --num_frames not given.
    predict_frames: Callable[[Request, dict], int] | None = None
    enhanced_prompt: str | None = None  # the prompt encoded instead of the request's (family.prompt_enhancer)


def checked_video(args, source, family, output_dir: Path, where: str = "") -> Video:
    """The request and media inputs `args` ask for (a list entry's flags merged in), checked before any
    weights load; `where` names the entry in errors."""
    defaults = {**family.request_defaults(source), "seed": DEFAULT_SEED}
    given = media_flags(args)
    accepted = family.media_inputs(source)
    try:
        inputs.check_given(args.model, accepted, given, models.MEDIA_INPUTS)
        values, records = inputs.read_inputs(accepted, given)
        size = family.size_from_inputs(source, values) if values else None
        if size is not None:  # the pipeline takes the video's size from the image
            if args.height is not None or args.width is not None:
                raise UserError(
                    f"--height/--width: --model {args.model!r} takes the video's size from the image "
                    f"({size[0]}x{size[1]} for this one, height x width); leave them out"
                )
            defaults.update(height=size[0], width=size[1])
        frames = inputs.frames_from_inputs(accepted, records, args.num_frames)
        if frames is not None:  # the pipeline makes as many frames as the video has
            defaults["num_frames"] = frames
        defaults.update(models.input_defaults(family, source, values))
        request = request_from_flags(args, family, args.model, defaults)
        models.check_option_inputs(family, request, values, accepted)
        for option in family.OPTIONS:  # a later pass's option is stored for stage 2, which refuses it from noise
            if option.start_only and request.option(option.name) is not None:
                log(f"note: {models.start_only_flag(family, request, option)} acts only on a {models.LATER_PASS}")
        predict = family.frames_from_prompt(source) if args.num_frames is None else None
        timed = [media.name for media in accepted if media.timed and media.name in values]
        if predict is not None and timed:  # their checks and encodes take the length, known only after the encode
            raise UserError(f"--{timed[0]}: give --num_frames (--model {args.model!r} would pick it from the prompt)")
        models.validate_request(family, source, request)
        family.check_inputs(source, request, values)
    except UserError as err:
        raise UserError(f"{where}: {err}" if where else str(err)) from None
    return Video(output_dir, request, values, records, inputs.task_of(accepted, values), predict)


def encode_and_write(args, dtype, source, family, video: Video, encode, runtime, timer: Timer, adapters=()) -> None:
    """One video's stage 1: its prompts and media inputs encoded, its folder written as a single run writes it."""
    request, output_dir = video.request, video.output_dir
    encoded = request if video.enhanced_prompt is None else dataclasses.replace(request, prompt=video.enhanced_prompt)
    with timer.phase("encode"), runtime.precision(dtype):
        embeddings = encode(encoded)
    if video.predict_frames is not None:  # the length the checkpoint picks from the prompt, recorded as asked
        request = dataclasses.replace(request, num_frames=video.predict_frames(request, embeddings))
        models.validate_request(family, source, request)
    if video.inputs:  # image encoders and VAE encodes on the runtime, fp32 matmuls (family.encode_inputs)
        log(f"encoding {', '.join(f'--{name}' for name in video.inputs)} on {runtime.describe()}")
        with timer.phase("encode_inputs"), torch.no_grad(), runtime.precision(torch.float32):
            embeddings.update(family.encode_inputs(source, request, video.inputs, runtime))
        inputs.record_processed_size(video.records, request.height, request.width)
    non_finite = [
        name for name, tensor in embeddings.items() if tensor.is_floating_point() and not tensor.isfinite().all()
    ]
    if non_finite:
        raise UserError(
            f"the text encoders produced NaN or Inf in {', '.join(non_finite)} ({args.dtype}; try --dtype fp32); "
            "nothing was written"
        )
    with timer.phase("save"):
        record = write_tensors(output_dir / STAGE1_FILE, embeddings)

    versions = ("transformers", "diffusers")
    prompts = {"prompt": request.prompt, "negative_prompt": request.negative_prompt}  # check_stage1_fresh
    task = {"task": video.task, **({"inputs": video.records} if video.inputs else {})}
    if video.predict_frames is not None:
        task["num_frames_from"] = "the prompt (the checkpoint's duration head)"
    if video.enhanced_prompt is not None:  # what was encoded; "prompts" keeps what was asked
        task["enhanced_prompt"] = video.enhanced_prompt
    section = {**record, "prompts": prompts, "request": request.to_config(), **task}  # request: as stage 1 wrote it
    section.update(run_record(runtime, args.dtype, timer.finish(), versions))
    if adapters:  # fused into the text connectors (LTX-2); stage 2 checks its --lora against them
        section["adapters"] = [lora_stage1.record(adapter) for adapter in adapters]
    write_stage_config(output_dir, request, later_sections(output_dir), "stage1", section)
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in embeddings.items())
    log(f"wrote {output_dir / STAGE1_FILE}: {shapes}")


def plan_main(args) -> None:
    """--plan: compile stage 1's device programs for a TPU slice, print the report, exit 0 (fits) or 3 (not)."""
    from tpu_video.planning import report as plan_report
    from tpu_video.planning.encoders import plan_stage1
    from tpu_video.planning.flags import executables_to_save, target_from_flag

    target = target_from_flag(args.plan)
    store = executables_to_save(args.save_executables, target)
    if args.prompts or args.seeds:
        raise UserError("--plan compiles one video's encodes: give --prompt, not --prompts or --seeds")
    source, family = models.resolve_model(args.model, configs_only=True)
    video = checked_video(args, source, family, Path(args.output_dir))
    if lora_stage1.read_adapters(args.lora, family, source, parse_dtype(args.dtype)):
        log("--lora: fused into the text connectors' weights, which keep their shapes: the programs are the same")
    log(f"planning {family.NAME} stage 1 for {target.name} ({target.topology}), every device on tp")
    report = plan_stage1(family, source, video.request, video.inputs, parse_dtype(args.dtype), target, store)
    plan_report.finish(report, args.plan_json, store)


def run(args) -> None:
    """Stage 1 for parsed flags (stage1_flags.build_parser): the script's main and the Python API call it."""
    if args.plan:
        return plan_main(args)
    refuse_planning_flags(args)
    check_backend_flags(args.backend, args.device, args.executables)
    dtype = parse_dtype(args.dtype)
    output_dir = Path(args.output_dir)
    entries = batch_folders.entries_from_flags(
        args.prompt, args.prompts, args.seed, args.seeds, tuple(media_flags(args))
    )

    source, family = models.resolve_model(args.model)
    log(f"stage 1 for {family.NAME}, model {args.model}")
    adapters = lora_stage1.read_adapters(args.lora, family, source, dtype)
    batch_folders.check_output_kind(output_dir, many=entries is not None)
    if entries is None:
        videos = [checked_video(args, source, family, output_dir)]
    else:
        folders = batch_folders.folder_names(entries)
        videos = [
            checked_video(
                argparse.Namespace(**{**vars(args), **entry.flags()}), source, family, output_dir / name, entry.where
            )
            for entry, name in zip(entries, folders, strict=True)
        ]
        ensure_writable_dir(output_dir, (batch_folders.BATCH_FILE,))
    for video in videos:
        ensure_writable_dir(video.output_dir, (STAGE1_FILE,))

    # One prompt at a time: with --backend torchax every device goes to `tp` (heads and MLP columns).
    runtime = open_runtime(args.backend, args.device, TP, not args.no_compile_cache, args.executables)
    timers = [Timer() for _ in videos]  # the first video's record holds the one load
    enhance = family.prompt_enhancer(source, dtype, runtime)
    if enhance is not None:  # before the text encoders load; the enhancer is freed with `enhance`
        for video, timer in zip(videos, timers, strict=True):
            with timer.phase("enhance"), torch.no_grad(), runtime.precision(dtype):
                video.enhanced_prompt = enhance(video.request, video.inputs)
        del enhance
    log(f"loading the text encoders on {runtime.describe()} in {args.dtype}")
    with timers[0].phase("load"), runtime.precision(dtype):
        encoded = lora_stage1.AdaptedSource(source, adapters, family) if adapters else source
        encode = family.prompt_encoder(encoded, dtype, runtime)
    for number, (video, timer) in enumerate(zip(videos, timers, strict=True), 1):
        if entries is not None:
            log(f"video {number} of {len(videos)}: {video.output_dir}")
        encode_and_write(args, dtype, source, family, video, encode, runtime, timer, adapters)
    if entries is not None:
        path = batch_folders.write_index(output_dir, [video.output_dir.name for video in videos], entries)
        log(f"wrote {path}: {len(videos)} stage folders")
