"""HunyuanVideo-1.5 image-to-video (diffusers `HunyuanVideo15ImageToVideoPipeline`).

The pipeline takes its video size from the image: the size bucket nearest the image's aspect ratio around the
transformer's `target_size`, the image centre-cropped to it (`size_from_inputs`; stage 1 refuses `--height` and
`--width` for these models). Stage 1 runs its SigLIP image encoder (`image_embeds`) and its VAE on the cropped
image (`image_latents`, the posterior's mode times the scaling factor, no sampling); stage 2 builds the
pipeline's condition channels from them (`prepare_cond_latents_and_mask`: the image latents in the first
latent frame, zeros after, and a first-frame mask) and runs the transformer with the image tokens valid.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import parse_dtype
from tpu_video.engine.encoders import DeviceImageEncoder, DeviceVAEEncoder
from tpu_video.engine.inputs import MediaInput
from utils import Request

from ..common import IMAGE
from .declarations import I2V_PIPELINE_CLASS
from .vae import make_vae_jit_safe


def image_to_video(source) -> bool:
    return source.index.get("_class_name") == I2V_PIPELINE_CLASS


def media_inputs(source) -> tuple[MediaInput, ...]:
    """The image-to-video pipeline takes a first frame (no last frame)."""
    return (IMAGE.required_here(),) if image_to_video(source) else ()


def _processor(source):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    spatial = source.load_config("vae")["spatial_compression_ratio"]
    return HunyuanVideo15ImageProcessor(vae_scale_factor=spatial, do_resize=False, do_convert_rgb=True)


def size_from_inputs(source, images: dict[str, Any]) -> tuple[int, int] | None:
    """(height, width) the pipeline derives from the image (its size bucket), or None for text-to-video."""
    if not image_to_video(source):
        return None
    width, height = images["image"].size
    target = source.load_config("transformer")["target_size"]
    return tuple(_processor(source).calculate_default_height_width(height=height, width=width, target_size=target))


def encode_inputs(source, request: Request, images: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's image conditioning in the request's dtype (it runs its image encoder and VAE in the
    pipeline's dtype): the image centre-cropped to the request's size bucket, its SigLIP tokens and its
    scaled VAE latents."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    dtype = parse_dtype(request.dtype)
    vae = DeviceVAEEncoder(make_vae_jit_safe(source.load("vae", dtype=dtype).eval()), runtime)
    encoder = DeviceImageEncoder(source.load("image_encoder", dtype=dtype).eval(), runtime)
    extractor = source.load("feature_extractor")
    processor = _processor(source)
    image = processor.resize(images["image"], height=request.height, width=request.width, resize_mode="crop")
    pipeline = HunyuanVideo15ImageToVideoPipeline
    with torch.no_grad():
        embeds = pipeline._get_image_embeds(encoder, extractor, image, "cpu").to(dtype)
        latents = pipeline._get_image_latents(vae, processor, image, request.height, request.width, "cpu")
    return {"image_embeds": embeds, "image_latents": latents}


def transformer_image_inputs(source, embeds, latents, pipe, dtype) -> list[tuple[torch.Tensor, tuple]]:
    """The guided transformer's image inputs: its image tokens (zeros for text-to-video, as that pipeline
    passes them) and for image-to-video the condition latents and mask."""
    if not image_to_video(source):
        config = pipe.transformer.config
        return [(torch.zeros(1, pipe.vision_num_semantic_tokens, config.image_embed_dim, dtype=dtype), ())]
    return [(embeds["image_embeds"].to(dtype), ()), *((tensor, ()) for tensor in condition(embeds, latents, dtype))]


def condition(embeds, latents: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`prepare_cond_latents_and_mask` from stage 1's image latents: the first latent frame holds them, the
    rest zeros; the mask is 1 on the first frame. Shapes follow `latents` (B, C, F, H, W)."""
    batch, _, frames, height, width = latents.shape
    cond = embeds["image_latents"].repeat(batch, 1, frames, 1, 1)
    cond[:, :, 1:] = 0
    mask = torch.zeros(batch, 1, frames, height, width, dtype=dtype)
    mask[:, :, 0] = 1.0
    return cond.to(dtype), mask


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stage 1's image tensors for a plan: SigLIP tokens and one latent frame (none for text-to-video)."""
    if not image_to_video(source):
        return {}
    vision = source.load_config("image_encoder")
    vae = source.load_config("vae")
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    spatial = vae["spatial_compression_ratio"]
    latent = (1, vae["latent_channels"], 1, request.height // spatial, request.width // spatial)
    return {
        "image_embeds": torch.zeros(1, tokens, vision["hidden_size"], dtype=dtype),
        "image_latents": torch.zeros(latent, dtype=dtype),
    }


def plans_inputs(source) -> bool:
    """Stage 1's `--plan` compiles every model of encode_inputs."""
    return True
