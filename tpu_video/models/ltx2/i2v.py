"""LTX-2 image-to-video (`LTX2ImageToVideoPipeline`): stage 1 re-encodes the image with H.264 as the model
was trained (`--image_crf`, diffusers' own PyAV helper), resizes it as the pipeline does and writes the
normalised VAE latents of that one frame; stage 2 starts the first latent frame from them, gives its tokens
timestep zero and never steps them (pipeline.py). The family's media-input hooks are here; a text-to-video
checkpoint's conditions (`--condition`) are conditions.py's."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.engine.encoders import DeviceVAEEncoder
from tpu_video.engine.inputs import MediaInput
from utils import Request

from ..common import IMAGE
from . import conditions
from .config import image_to_video, vae_ratios
from .crf import check_h264_size, recompress
from .declarations import CONDITION
from .enhance import check_enhancement
from .latents import latent_statistics

IMAGE_LATENTS = "image_latents"  # (1, C, 1, H/32, W/32): the first frame's normalised VAE latents


def media_inputs(source) -> tuple[MediaInput, ...]:
    return (IMAGE.required_here(),) if image_to_video(source) else (CONDITION,)


def plans_inputs(source) -> bool:
    return True  # the re-encode is a host step before the model; the VAE encode runs on the runtime


def check_inputs(source, request: Request, images: dict[str, Any]) -> None:
    """Stage 1, before the text encoder loads: the re-encode's PyAV is installed (without this check a missing
    extra stopped the run only after the text encode), and the image has the 2 x 2 pixels H.264 needs (its
    helper crops to even sides: a side of 1 became 0 and an IndexError); the prompt enhancer's flags."""
    check_enhancement(source, request)  # every task's stage-1 check is this one
    if CONDITION.name in images:
        conditions.check_conditions(source, request, images[CONDITION.name])
    elif image_to_video(source) and (crf := request.option("image_crf")):  # crf 0: no image to check
        check_h264_size(crf, images["image"], "--image")


def encode_inputs(source, request: Request, images: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's first-frame conditioning: the H.264 round trip, its bilinear resize to the request's
    size, the float32 VAE's posterior mode, normalised by the VAE's statistics (`prepare_latents`; the noise
    it blends with is drawn in stage 2)."""
    if CONDITION.name in images:
        return conditions.encode_conditions(source, request, images[CONDITION.name], runtime)
    from diffusers import LTX2ImageToVideoPipeline
    from diffusers.video_processor import VideoProcessor

    vae = source.load("vae", dtype=torch.float32).eval()
    processor = VideoProcessor(vae_scale_factor=vae_ratios(source)[0], resample="bilinear")
    image = recompress(images["image"], request.option("image_crf"))
    pixels = processor.preprocess(image, height=request.height, width=request.width).float()
    # From the checkpoint, not the module: placed (torchax) buffers cannot be used on the host, and --plan's VAE is
    # on the meta device.
    mean, std = latent_statistics(source, "vae")
    posterior = DeviceVAEEncoder(vae, runtime).encode(pixels.unsqueeze(2)).latent_dist
    # The pipeline normalises without the VAE's scaling_factor (its de-normalisation uses it; 1.0 when published).
    latents = LTX2ImageToVideoPipeline._normalize_latents(posterior.mode(), mean, std)
    return {IMAGE_LATENTS: latents.contiguous()}


def conditioning_mask(frames: int, height: int, width: int, patch: int, patch_t: int) -> torch.Tensor:
    """(1, tokens) float32: 1 on the first latent frame's packed tokens (the pipeline's packed mask)."""
    from diffusers import LTX2ImageToVideoPipeline

    mask = torch.zeros(1, 1, frames, height, width)
    mask[:, :, 0] = 1.0
    return LTX2ImageToVideoPipeline._pack_latents(mask, patch, patch_t).squeeze(-1)
