"""Stage 3 for parsed flags (`run`; `plan_main` for --plan), and its work per folder: where it writes
(`output_paths`, the preview and frames files beside the video), the frame programs it runs
(`chunk_frames_choice`), one folder read and checked before any work (`checked_video`), and its decode with
the mp4, soundtrack, preview, frames and the `stage3` section (`decode_and_write`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from sharding import SP
from tpu_video import models
from tpu_video.cli import UserError, log, parse_dtype, refuse_planning_flags
from tpu_video.cli.folders import hold as hold_folder
from tpu_video.engine import batch_folders
from tpu_video.engine.decode import decode, decode_soundtrack, soundtrack_runtime
from tpu_video.engine.media import write_mp4, write_preview_png
from tpu_video.runtime.backend import check_backend_flags, choose_backend, open_runtime
from tpu_video.runtime.interface import Timer, run_record
from tpu_video.stages.stage3_flags import PLAN_REQUEST_KEYS
from utils import (
    CONFIG_FILE,
    DEFAULT_OUTPUT_DIR,
    VIDEO_FILE,
    Request,
    check_output_dir,
    check_stage1_fresh,
    check_stage2_fresh,
    describe_folder,
    ensure_writable_dir,
    read_config,
    read_tensors,
    stage2_normalization,
    stage_sections,
    write_stage_config,
    write_tensors,
)


def preview_name(video_name: str) -> str:
    return str(Path(video_name).with_suffix("")) + "_preview.png"


def frames_name(video_name: str) -> str:
    return str(Path(video_name).with_suffix("")) + "_frames.safetensors"


def output_paths(args, input_dir: Path) -> tuple[Path, str]:
    """The video's folder and name: --output_dir/--output_name, or the reference's --output_video PATH."""
    if args.output_video is None:
        if Path(args.output_name).suffix.lower() != ".mp4":
            raise UserError(f"--output_name {args.output_name!r}: the video is an mp4 (name it .mp4)")
        return Path(args.output_dir or input_dir), args.output_name
    if args.output_dir is not None or args.output_name != VIDEO_FILE:
        raise UserError("--output_video names the folder and the file; drop --output_dir and --output_name")
    path = Path(args.output_video)
    if path.suffix.lower() != ".mp4":
        raise UserError(f"--output_video {path}: the video is an mp4 (name it .mp4)")
    return path.parent, path.name


def chunk_frames_choice(args, family, backend: str) -> int | None:
    """Latent frames per compiled call (None: one program): the family's default on torchax, checked."""
    given = args.chunk_frames
    if backend != "torchax":
        if given:
            raise UserError(f"--chunk_frames applies to --backend torchax; --backend {backend} runs the stock decode")
        return None
    if given is None:
        return None if args.tiling or not family.CHUNK_FRAMES else family.CHUNK_FRAMES[0]
    if given == 0:
        return None
    if not family.CHUNK_FRAMES:
        raise UserError(
            f"--chunk_frames {given}: the {family.NAME} decode runs as one program (give 0 or leave it out)"
        )
    if given not in family.CHUNK_FRAMES:
        allowed = family.CHUNK_FRAMES
        if isinstance(allowed, range):
            allowed = f"{allowed.start} to {allowed.stop - 1}"
        else:
            allowed = ", ".join(map(str, allowed))
        raise UserError(f"--chunk_frames {given}: the {family.NAME} decode is exact in chunks of {allowed} (or 0)")
    if args.tiling:
        raise UserError("--tiling is diffusers' tiled decode in one program; with --chunk_frames drop it")
    return given


@dataclasses.dataclass
class Video:
    """One folder's decode, checked: where it reads and writes, its request, model and latents."""

    input_dir: Path
    output_dir: Path
    output_name: str
    config: dict
    request: Request
    overrides: dict
    source: object
    family: object
    dtype_name: str
    normalization: dict  # what stage 2 recorded, undone before decoding
    tensors: dict  # every tensor stage 2 wrote (LTX-2: `audio_latents` too)

    @property
    def latents(self) -> torch.Tensor:
        return self.tensors["latents"]


def checked_video(args, input_dir: Path) -> Video:
    """Read and check one input folder (fresh stage files, a writable output), before anything decodes."""
    output_dir, output_name = output_paths(args, input_dir)
    hold_folder(input_dir, write=output_dir.resolve() == input_dir.resolve())  # no stage 2 rewriting it meanwhile
    config = read_config(input_dir, needs="stage2")
    log(describe_folder(input_dir, config))
    request, overrides = Request.from_config(config, input_dir / CONFIG_FILE).with_overrides({"fps": args.fps})
    source, family = models.resolve_model_for_request(request, args.model)
    check_stage1_fresh(input_dir, config, request)
    check_stage2_fresh(input_dir, config, request, models.stage1_only(family))
    dtype_name = args.dtype or request.dtype
    parse_dtype(dtype_name)
    if family.Soundtrack is not None and args.fps is not None and args.fps != config["fps"]:
        raise UserError(
            f"--fps {args.fps}: this {family.NAME} video's soundtrack was generated for {config['fps']} fps (stage 1's "
            "--fps); another frame rate would play the pictures out of step with it"
        )
    tensors = read_tensors(input_dir, config["stage2"])
    normalization = stage2_normalization(config["stage2"], lambda: family.latents_normalization(source))
    source.load_config("vae")  # a model folder without a VAE is refused here, before any folder decodes
    tensors, normalization = family.upgrade_stage2(source, tensors, normalization)
    hold_folder(output_dir, write=True)  # an existing output folder, before it is checked
    check_output_dir(output_dir, input_dir, config)
    ensure_writable_dir(output_dir, (output_name, preview_name(output_name), frames_name(output_name)))
    fields = (config, request, overrides, source, family, dtype_name, normalization, tensors)
    return Video(input_dir, output_dir, output_name, *fields)


def joined_segments(decode_one, latents: torch.Tensor, config: dict) -> torch.Tensor:
    """A video stage 2 made in segments (its record's `segments`): each row of the latents decoded apart, the
    first `overlap_frames` of every segment after the first dropped (the previous segment's last frames, which
    it was conditioned on), the rest joined and cut to `frames_kept` (the pose video's length)."""
    joined = config["stage2"]["segments"]
    if len(latents) != joined["count"]:
        raise UserError(f"stage 2 recorded {joined['count']} segments; its latents hold {len(latents)}: rerun stage 2")
    pieces = [decode_one(latents[index : index + 1]) for index in range(joined["count"])]
    frames = torch.cat([pieces[0], *(piece[joined["overlap_frames"] :] for piece in pieces[1:])])
    padding = (
        f"; the last {len(frames) - joined['frames_kept']} pad the last segment"
        if len(frames) > joined["frames_kept"]
        else ""
    )
    log(
        f"{joined['count']} segment(s) of {len(pieces[0])} frames decoded and joined: {len(frames)} frames, "
        f"the first {joined['frames_kept']} kept (the pose video's{padding})"
    )
    return frames[: joined["frames_kept"]]


def decode_and_write(args, video: Video, runtime, backend: str, reason: str, vaes: dict) -> None:
    """Decode one folder's latents (with the VAE `vaes` holds for its model, loaded on first use) and write
    its mp4, preview, frames and config section as a single run does."""
    family, source, request, latents, config = video.family, video.source, video.request, video.latents, video.config
    output_dir, output_name, dtype_name = video.output_dir, video.output_name, video.dtype_name
    dtype = parse_dtype(dtype_name)
    timer = Timer()
    chunk_frames = chunk_frames_choice(args, family, backend)
    how = f"{chunk_frames} latent frame(s) per call" if chunk_frames else "one program"
    log(
        f"decoding latents {tuple(latents.shape)} with the {family.NAME} VAE, {runtime.describe()}, {dtype_name}, {how}"
    )
    if (source.location, dtype) not in vaes:
        with timer.phase("load"):
            vaes[source.location, dtype] = source.load("vae", dtype=dtype).eval()
    vae = vaes[source.location, dtype]
    fields = (video.normalization, dtype, runtime, timer, args.tiling, chunk_frames)
    with runtime.precision(dtype):
        if "segments" in config["stage2"]:  # Wan Animate: one segment per row, each decoded as the pipeline does
            frames = joined_segments(lambda one: decode(family, source, one, *fields, vae=vae), latents, config)
        else:
            frames = decode(family, source, latents, *fields, vae=vae)
    if not torch.isfinite(frames).all():
        raise UserError(
            f"the decoded frames hold NaN or Inf: the VAE overflowed in {dtype_name} (try --dtype fp32), or the "
            f"latents are extreme (abs max {latents.float().abs().max().item():.3g}; a very large --guidance_scale?); "
            "nothing was written"
        )
    pixels = (frames.numpy() * 255).round().astype(np.uint8)
    audio = None
    if family.Soundtrack is not None:
        where = soundtrack_runtime(runtime, backend)
        with where.precision(dtype):
            audio = decode_soundtrack(family, source, video.tensors["audio_latents"], dtype, where, timer, vaes)
    with timer.phase("save"):
        write_mp4(output_dir / output_name, pixels, request.fps, audio)
        preview = None
        if args.preview_frames:
            preview = preview_name(output_name)
            rows, columns = write_preview_png(output_dir / preview, pixels, count=args.preview_frames)
        if args.save_frames:  # exactly what went into the encoder, and the decode before quantisation
            saved = {"frames": torch.from_numpy(pixels), "frames_float": frames.float()}
            if audio is not None:
                saved["waveform"] = audio[0]  # float32, lossless (the mp4's AAC track is not)
            frames_record = write_tensors(output_dir / frames_name(output_name), saved)

    count, height, width, _ = pixels.shape
    section = {
        "file": output_name,
        "latents_sha256": config["stage2"]["sha256"],
        "frames": count,
        "height": height,
        "width": width,
        "fps": request.fps,
        "tiling": args.tiling,
        "chunk_frames": chunk_frames,
        "overrides": video.overrides,
        "backend_choice": reason,
        **run_record(runtime, dtype_name, timer.finish(), ("diffusers", "imageio-ffmpeg")),
    }
    if audio is not None:
        waveform, rate = audio
        channels, samples = waveform.shape
        section["audio"] = {
            "codec": "aac",
            "sample_rate": rate,
            "channels": channels,
            "samples": samples,
            "decoded_on": where.describe(),
        }
    if preview:
        section.update(preview=preview, preview_grid=[rows, columns])
    if args.save_frames:
        section["frames_file"] = frames_record
    write_stage_config(output_dir, request, stage_sections(config), "stage3", section)
    sound = ""
    if audio is not None:
        sound = f", with a {samples / rate:.2f} s {channels}-channel AAC soundtrack at {rate} Hz"
    log(f"wrote {output_dir / output_name}: {count} frames x {height} x {width} at {request.fps} fps{sound}")
    if preview:
        log(f"wrote {output_dir / preview}: {rows} x {columns} grid of frames")
    if args.save_frames:
        log(f"wrote {output_dir / frames_name(output_name)}: {', '.join(frames_record['tensors'])} (--save_frames)")


def plan_main(args) -> None:
    """--plan: compile the decode for a TPU slice, print the report, exit 0 (fits) or 3 (does not fit)."""
    from tpu_video.planning import plan
    from tpu_video.planning import report as plan_report
    from tpu_video.planning.flags import executables_to_save, plan_folder, planned_request, target_from_flag

    target = target_from_flag(args.plan)
    store = executables_to_save(args.save_executables, target)
    flags = {key: getattr(args, key) for key in PLAN_REQUEST_KEYS}
    if args.input_dir and len(args.input_dir) > 1:
        raise UserError("--plan compiles one decode: give one --input_dir (or none, with --model)")
    request, source, family = planned_request(plan_folder(args.input_dir, args.model), args.model, flags, args.dtype)
    dtype = parse_dtype(args.dtype or request.dtype)
    chunk_frames = chunk_frames_choice(args, family, "torchax")  # what a TPU run would take
    log(f"planning the {family.NAME} decode for {target.name} ({target.topology}), tiling {args.tiling}")
    report = plan.plan_stage3(family, source, request, dtype, target, args.tiling, chunk_frames, store=store)
    plan_report.finish(report, args.plan_json, store)


def run(args) -> None:
    """Stage 3 for parsed flags (stage3_flags.build_parser): the script's main and the Python API call it."""
    if args.plan:
        return plan_main(args)
    planning_only = ("plan_json", "save_executables", *PLAN_REQUEST_KEYS)
    refuse_planning_flags(args, planning_only, " (stage 3 decodes the latents stage 2 wrote)")
    if args.dp is not None:
        raise UserError(
            "--dp: stage 3 has no data-parallel axis; with --backend torchax it splits the latents' width over "
            "all devices (the reference's Flax decoder took --dp); drop the flag"
        )
    check_backend_flags(args.backend, args.device, args.executables)
    if args.preview_frames < 0:
        raise UserError(f"--preview_frames {args.preview_frames} must be >= 0")
    folders = batch_folders.expand_folders(args.input_dir or [DEFAULT_OUTPUT_DIR])
    if len(folders) > 1 and (args.output_dir or args.output_video or args.output_name != VIDEO_FILE):
        raise UserError(
            "--output_dir/--output_name/--output_video name one video; with several input folders each video is "
            "written into its own folder"
        )
    videos = [checked_video(args, folder) for folder in folders]  # every folder checked before any work

    # With --backend torchax the VAE's weights are replicated and its activations split spatially
    # (engine.decode.latents_split).
    backend, device, reason = choose_backend(args.backend, args.device)
    log(f"--backend {args.backend}: {reason}")
    runtime = open_runtime(backend, device, SP, not args.no_compile_cache, args.executables)
    vaes: dict = {}  # one loaded VAE per model and dtype, for every folder that uses it
    for number, video in enumerate(videos, 1):
        if len(videos) > 1:
            log(f"video {number} of {len(videos)}: {video.input_dir}")
        decode_and_write(args, video, runtime, backend, reason, vaes)
