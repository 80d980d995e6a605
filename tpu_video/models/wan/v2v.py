"""Wan video-to-video (`WanVideoToVideoPipeline`): a text-to-video Wan folder given `--video` restyles that
video. Stage 1 resizes its frames with the pipeline's video processor and VAE-encodes them (the latents'
mode, normalised as the pipeline normalises them: `video_latents`); stage 2 runs the last `int(steps x
strength)` steps of the schedule from those latents noised to the first of them, as the pipeline's
`get_timesteps` and `prepare_latents` do. No checkpoint names this pipeline, so the flag chooses it; Wan 2.2
A14B (two experts) and TI2V-5B have no video-to-video pipeline in diffusers 0.42.1 and refuse it."""

from __future__ import annotations

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.inputs import MediaInput
from utils import Request

from . import ti2v
from .config import image_to_video, stock_pipeline, strength_steps
from .declarations import VIDEO
from .vae_encode import device_encoder

VIDEO_LATENTS = "video_latents"


def takes_video(source) -> bool:
    """A one-transformer text-to-video Wan folder (what WanVideoToVideoPipeline loads)."""
    one = source.index.get("boundary_ratio") is None
    return one and not image_to_video(source) and not ti2v.expand_timesteps(source)


def encode_video(source, request: Request, frames: list, runtime) -> dict[str, torch.Tensor]:
    """The pipeline's preprocessing and VAE encode of the first `num_frames` frames in float32 on `runtime`
    (vae_encode.py: 4 frames per program call):
    `video_latents`, the mode of the VAE's latents normalised with its config's mean and std (the
    pipeline's expressions, so the same rounding)."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    vae = source.load("vae", dtype=torch.float32).eval()
    pipe = stock_pipeline(source, vae=vae)
    size = {"height": request.height, "width": request.width}
    video = pipe.video_processor.preprocess_video(frames[: request.num_frames], **size)
    log(f"--video: {request.num_frames} frames VAE-encoded at {request.height}x{request.width}")
    encoder = device_encoder(source, vae, runtime, request.height, request.width)
    with torch.no_grad():
        latents = retrieve_latents(encoder.encode(video.to(dtype=torch.float32)), sample_mode="argmax").float()
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.dtype)
    return {VIDEO_LATENTS: (latents - mean) * std}


def loop_start(scheduler, request: Request, embeds: dict, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The first latents (the video's, noised to the truncated schedule's first timestep as the pipeline's
    prepare_latents does, before any step sets the scheduler's index) and the schedule index it starts at."""
    first = strength_steps(request)[0] * scheduler.order  # where the pipeline's truncated schedule starts
    timesteps = scheduler.timesteps[first:]
    start = timesteps[:1]
    video = embeds[VIDEO_LATENTS].float()
    if video.shape != noise.shape:
        raise UserError(f"the stage-1 video latents are {tuple(video.shape)}; this run's are {tuple(noise.shape)}")
    if hasattr(scheduler, "add_noise"):
        latents = scheduler.add_noise(video, noise, start)
    else:
        latents = scheduler.scale_noise(video, start, noise)
    steps = len(scheduler.timesteps)
    log(f"video-to-video: steps {first + 1} to {steps} of {steps} (--strength {request.option('strength')})")
    return latents, first


def media_video(source) -> tuple[MediaInput, ...]:
    return (VIDEO,) if takes_video(source) else ()
