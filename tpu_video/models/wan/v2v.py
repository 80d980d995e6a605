"""Wan video-to-video (`WanVideoToVideoPipeline`): a text-to-video Wan folder given `--video` restyles that
video. Stage 1 resizes its frames with the pipeline's video processor and VAE-encodes them (the latents'
mode, normalised as the pipeline normalises them: `video_latents`); stage 2 runs the last `int(steps x
strength)` steps of the schedule from those latents noised to the first of them, as the pipeline's
`get_timesteps` and `prepare_latents` do. No checkpoint names this pipeline, so the flag chooses it; Wan 2.2
A14B (two experts) and TI2V-5B have no video-to-video pipeline in diffusers 0.42.1 and refuse it."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.inputs import MediaInput, video_input
from utils import Request

from . import ti2v
from .config import image_to_video, stock_pipeline

VIDEO = video_input(
    "video",
    "video-to-video: the video to restyle (a video file ffmpeg reads, or a folder of frame images), on Wan "
    "text-to-video models; --strength says how much is redrawn",
)
VIDEO_LATENTS = "video_latents"
DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline.__call__'s


def takes_video(source) -> bool:
    """A one-transformer text-to-video Wan folder (what WanVideoToVideoPipeline loads)."""
    one = source.index.get("boundary_ratio") is None
    return one and not image_to_video(source) and not ti2v.expand_timesteps(source)


def strength_steps(request: Request) -> tuple[int, int]:
    """(the first step of the schedule the run starts at, how many it runs): the pipeline's get_timesteps."""
    steps = request.num_inference_steps
    strength = DEFAULT_STRENGTH if request.option("strength") is None else request.option("strength")
    init = min(int(steps * strength), steps)
    return max(steps - init, 0), init


def check_video(source, request: Request, frames: list) -> None:
    """Before any weights load: a strength that runs at least one step, and a frame count the VAE takes."""
    strength = request.option("strength")
    if strength is not None and not 0 < strength <= 1:
        raise UserError(f"--strength {strength} must be above 0 and at most 1 (1: every step, from pure noise)")
    if strength_steps(request)[1] < 1:
        raise UserError(
            f"--strength {strength} of {request.num_inference_steps} steps runs none (int(steps x strength) is 0); "
            "give a larger --strength or more --num_inference_steps"
        )
    if request.num_frames > len(frames):
        raise UserError(f"--num_frames {request.num_frames}: --video has {len(frames)} frames")


def encode_video(source, request: Request, frames: list) -> dict[str, torch.Tensor]:
    """The pipeline's preprocessing and VAE encode of the first `num_frames` frames in float32 on the host:
    `video_latents`, the mode of the VAE's latents normalised with its config's mean and std (the
    pipeline's expressions, so the same rounding)."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    vae = source.load("vae", dtype=torch.float32).eval()
    pipe = stock_pipeline(source, vae=vae)
    size = {"height": request.height, "width": request.width}
    video = pipe.video_processor.preprocess_video(frames[: request.num_frames], **size)
    log(f"--video: {request.num_frames} frames VAE-encoded on the host CPU at {request.height}x{request.width}")
    with torch.no_grad():
        latents = retrieve_latents(vae.encode(video.to(dtype=torch.float32)), sample_mode="argmax").float()
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.dtype)
    return {VIDEO_LATENTS: (latents - mean) * std}


def loop_start(scheduler, request: Request, embeds: dict, noise: torch.Tensor) -> tuple[Any, torch.Tensor, int]:
    """The truncated schedule, the first latents (the video's, noised to its first timestep as the pipeline's
    prepare_latents does, before any step sets the scheduler's index) and the schedule index it starts at."""
    first, _ = strength_steps(request)
    timesteps = scheduler.timesteps[first * scheduler.order :]
    start = timesteps[:1]
    video = embeds[VIDEO_LATENTS].float()
    if video.shape != noise.shape:
        raise UserError(f"the stage-1 video latents are {tuple(video.shape)}; this run's are {tuple(noise.shape)}")
    if hasattr(scheduler, "add_noise"):
        latents = scheduler.add_noise(video, noise, start)
    else:
        latents = scheduler.scale_noise(video, start, noise)
    log(f"video-to-video: steps {first + 1} to {request.num_inference_steps} of {request.num_inference_steps}")
    return timesteps, latents, first


def media_video(source) -> tuple[MediaInput, ...]:
    return (VIDEO,) if takes_video(source) else ()
