"""Wan image-to-video (`WanImageToVideoPipeline`): stage 1 runs the pipeline's own image conditioning (CLIP
tokens where the transformer has an image embedder, the mask and VAE latents of the first and last frames);
each step the guided transformer concatenates it to the latents on channels and feeds the CLIP tokens to
both branches. TI2V-5B's image path is in ti2v.py."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.encoders import DeviceImageEncoder, DeviceVAEEncoder
from tpu_video.engine.inputs import MediaInput
from utils import Request

from ..common import IMAGE, LAST_IMAGE
from . import animate, animate_inputs, ti2v, v2v, vace
from .config import image_to_video, stock_pipeline
from .declarations import ANIMATE_INPUTS, VACE_INPUTS
from .vae_encode import device_encoder


def media_inputs(source) -> tuple[MediaInput, ...]:
    """WanImageToVideoPipeline takes a first frame, and a last one where its transformer can use two: Wan
    2.2 A14B (no image embedder) or one with a position embedding for two images (FLF2V). Wan 2.1 I2V's
    embedder takes one image; diffusers 0.42.1 fails on a last frame there (image batch 2, text batch 1)."""
    if vace.is_vace(source):
        return VACE_INPUTS
    if animate.is_animate(source):
        return ANIMATE_INPUTS
    if ti2v.expand_timesteps(source):  # TI2V-5B: text-to-video, or image-to-video with --image
        return (IMAGE,)
    if not image_to_video(source):
        return v2v.media_video(source)  # video-to-video on a one-transformer text-to-video folder
    config = source.load_config("transformer")
    two = config.get("image_dim") is None or config.get("pos_embed_seq_len") is not None
    return (IMAGE.required_here(), LAST_IMAGE) if two else (IMAGE.required_here(),)


def encode_inputs(source, request: Request, images: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's image conditioning, computed by its own methods in float32 (its example loads the VAE and
    image encoder in float32; both run on the runtime, the VAE through vae_encode.py): the CLIP embeddings of the
    image(s) where the transformer has an image embedder (`image_embeds`), and `condition`: the first-frame mask and
    the normalised VAE latents of [image, zeros..., last image] (`prepare_latents`; its noise is drawn in stage 2).
    TI2V-5B: tpu_video/models/ti2v.py. Video-to-video: v2v.py. VACE: vace.py. Animate: animate.py."""
    if vace.is_vace(source):
        return vace.encode(source, request, images, runtime)
    if animate.is_animate(source):
        return animate_inputs.encode(source, request, images, runtime)
    if "video" in images:
        return v2v.encode_video(source, request, images["video"], runtime)
    if ti2v.expand_timesteps(source):
        vae = DeviceVAEEncoder(source.load("vae", dtype=torch.float32).eval(), runtime)
        return ti2v.encode_image(source, request, images["image"], vae)
    config = source.load_config("transformer")
    vae = source.load("vae", dtype=torch.float32).eval()
    components = {"vae": device_encoder(source, vae, runtime, request.height, request.width)}
    log(f"the condition video ({request.num_frames} frames) is VAE-encoded one chunk of frames at a time")
    if config.get("image_dim") is not None:
        encoder = source.load("image_encoder", dtype=torch.float32).eval()
        components["image_encoder"] = DeviceImageEncoder(encoder, runtime)
        components["image_processor"] = source.load("image_processor")
    pipe = stock_pipeline(source, **components)
    first, last = images["image"], images.get("last_image")
    tensors = {}
    height, width, frames = request.height, request.width, request.num_frames
    with torch.no_grad():
        if "image_encoder" in components:
            tensors["image_embeds"] = pipe.encode_image(first if last is None else [first, last], "cpu")
        first, last = (
            None if image is None else pipe.video_processor.preprocess(image, height=height, width=width).float()
            for image in (first, last)
        )
        z_dim, spatial = source.load_config("vae")["z_dim"], pipe.vae_scale_factor_spatial
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        noise_shape = (1, z_dim, latent_frames, height // spatial, width // spatial)
        _, tensors["condition"] = pipe.prepare_latents(
            first, 1, z_dim, height, width, frames, torch.float32, "cpu", None, torch.zeros(noise_shape), last
        )
    return tensors


def image_conditioning(source, embeds, dtype) -> list[tuple[torch.Tensor, tuple]]:
    """Stage 1's image conditioning as the guided transformer's extra inputs (`condition` in float32, cast
    with the latents as the pipeline does; `image_embeds` in the transformer's dtype), checked against the
    model: an image-to-video transformer needs them, a text-to-video one cannot take them."""
    if ti2v.expand_timesteps(source):  # either task; the image's latents enter through ti2v.loop_parts
        return []
    wants = image_to_video(source)
    if wants != ("condition" in embeds):
        have = "image conditioning (stage 1 had --image)" if "condition" in embeds else "no image conditioning"
        raise UserError(
            f"the stage-1 files hold {have}, but --model {source.ref!r} is "
            f"{'an image' if wants else 'a text'}-to-video model; rerun stage 1 for this model"
        )
    if not wants:
        return []
    inputs = [(embeds["condition"].float(), ())]
    if source.load_config("transformer").get("image_dim") is not None:
        inputs.append((embeds["image_embeds"].to(dtype), ()))
    return inputs


def plans_inputs(source) -> bool:
    """Stage 1's `--plan` compiles every model of encode_inputs: CLIP, the VAE's encodes (TI2V-5B's one program,
    the others' chunk programs: vae_encode.py)."""
    return True


def check_inputs(source, request: Request, inputs: dict[str, Any]) -> None:
    """Stage 1, before any weights load: VACE's and Animate's inputs; the others need no more checks."""
    if vace.is_vace(source):
        vace.check_inputs(source, request, inputs)
    if animate.is_animate(source):
        animate_inputs.check_inputs(source, request, inputs)
