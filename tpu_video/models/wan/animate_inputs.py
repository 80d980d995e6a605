"""Wan Animate's stage 1 (animate.py has the rest): its inputs checked before any weights load, and the pipeline's
own preprocessing and encodes, in float32 as its example loads the VAE, on stage 1's runtime (the VAE one chunk of
frames per program call: vae_encode.py): the character's CLIP tokens (`image_embeds`, its next-to-last layer), the
character resized to the request (the pipeline's fill) and VAE-encoded behind the image-to-video mask, the first
segment's condition latents behind theirs (zeros in `animate` mode; in `replace` mode the background, with the
inverted mask on the latent grid), every segment's pose latents, and the padded face video's pixels at the motion
encoder's size (and in `replace` mode the background and mask videos' pixels, which stage 2 encodes with the
segments it makes)."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError, log
from utils import Request

from .animate import (
    BACKGROUND,
    CHARACTER,
    CONDITION,
    FACE,
    MASK,
    POSE,
    latent_frames,
    segment_count,
    segment_options,
    stored_pixels,
)
from .config import stock_pipeline
from .vae_encode import device_encoder


def check_inputs(source, request: Request, inputs: dict[str, Any]) -> None:
    """Pose and face videos of one length, and the background and mask videos with --mode replace only, of that
    length too."""
    mode = request.option("mode") or "animate"
    pose = len(inputs["pose_video"])
    named = {name: inputs[name] for name in ("face_video", "background_video", "mask_video") if name in inputs}
    for name, frames in named.items():
        if len(frames) != pose:
            raise UserError(
                f"--{name} has {len(frames)} frames and --pose_video {pose}: give videos of the same length (the "
                "preprocessing that makes them from one driving video does)"
            )
    replace = [name for name in ("background_video", "mask_video") if name in inputs]
    if mode == "replace" and len(replace) < 2:
        raise UserError("--mode replace: give --background_video and --mask_video (the person to replace, where)")
    if mode == "animate" and replace:
        raise UserError(f"--{replace[0]}: only --mode replace uses it (--mode is animate)")


def encode(source, request: Request, inputs: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's conditioning, by its own methods, in float32 (the VAE and CLIP on `runtime`)."""
    from tpu_video.engine.encoders import DeviceImageEncoder
    from tpu_video.engine.meta import meta_module

    length, previous = segment_options(request)
    count, target = segment_count(request)
    mode = request.option("mode") or "animate"
    height, width, frames = request.height, request.width, request.num_frames
    vae = source.load("vae", dtype=torch.float32).eval()
    pipe = stock_pipeline(
        source,
        vae=device_encoder(source, vae, runtime, request.height, request.width),
        image_processor=source.load("image_processor"),
        image_encoder=DeviceImageEncoder(source.load("image_encoder", dtype=torch.float32).eval(), runtime),
        transformer=meta_module(source, "transformer", torch.float32),  # the pipeline reads its patch and face sizes
    )
    face_size = pipe.transformer.config.motion_encoder_size
    log(
        f"Animate ({mode}): the character and {frames} pose frames (padded to {target}: {count} segment(s) of "
        f"{length}) VAE-encoded at {height}x{width}; the face frames resized to {face_size}x{face_size}"
    )
    temporal = source.load_config("vae")["scale_factor_temporal"]
    enough = (frames - 1 + temporal - 1) // temporal * temporal + 1  # the shortest 4n+1 segment holding them
    if count == 1 and enough < length:
        log(f"note: --segment_frame_length {enough} would hold the {frames} frames with less padding (less work)")

    def video(name, processor=pipe.video_processor, size=(height, width)):
        padded = pipe.pad_video_frames(inputs[name][:frames], target)
        return processor.preprocess_video(padded, height=size[0], width=size[1]).float()

    starts = range(0, count * (length - previous), length - previous)
    tensors = {}
    with torch.no_grad():
        image = inputs["image"]
        pixels = pipe.vae_image_processor.preprocess(image, height=height, width=width, resize_mode="fill").float()
        tensors[CHARACTER] = pipe.prepare_reference_image_latents(pixels, 1, device="cpu")
        pose = video("pose_video")
        tensors[POSE] = torch.cat([pipe.prepare_pose_latents(pose[:, :, at : at + length], 1) for at in starts])
        tensors[FACE] = video("face_video", size=(face_size, face_size))
        background = mask = None
        if mode == "replace":
            background, mask = video("background_video"), video("mask_video", pipe.video_processor_for_mask)
            tensors[BACKGROUND], tensors[MASK] = stored_pixels(background, True), stored_pixels(mask, False)
            background, mask = background[:, :, :length], mask[:, :, :length]
        tensors[CONDITION] = pipe.prepare_prev_segment_cond_latents(
            None, background, mask, 1, length, 0, height, width, previous, mode, device="cpu"
        )
        tensors["image_embeds"] = pipe.encode_image(image, "cpu").float()
    return tensors


def planning_embeds(source, request: Request) -> dict[str, torch.Tensor]:
    """Zeros of stage 1's Animate tensors' shapes in `animate` mode (to plan before encoding)."""
    vae, transformer = source.load_config("vae"), source.load_config("transformer")
    spatial, frames = vae["scale_factor_spatial"], latent_frames(source, request)
    grid = (request.height // spatial, request.width // spatial)
    vision = source.load_config("image_encoder")
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + 1  # CLIP: patches and the class token
    face, channels = transformer["motion_encoder_size"], vae["scale_factor_temporal"] + vae["z_dim"]  # mask, latents
    count, target = segment_count(request)
    return {
        "image_embeds": torch.zeros(1, tokens, transformer["image_dim"]),
        CHARACTER: torch.zeros(1, channels, 1, *grid),
        CONDITION: torch.zeros(1, channels, frames - 1, *grid),
        POSE: torch.zeros(count, vae["z_dim"], frames - 1, *grid),
        FACE: torch.zeros(1, 3, target, face, face),
    }
