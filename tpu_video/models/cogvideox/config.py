"""CogVideoX 1.0 and 1.5's facts and request rules: the documented defaults, and what the VAE, the patching and
the positional embeddings accept (checked before any weights load)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tpu_video.cli import UserError
from utils import Request

from .. import common

LORA_LOADER = "CogVideoXLoraLoaderMixin"  # reads adapters; load_lora_adapter converts older diffusers keys
STEP_CACHES = ("magcache", "interval")  # the --cache kinds it runs (docs/caching.md)

# Documented per-variant defaults (model cards). The pipeline's own fallback (transformer
# sample_height x 8) would give 2400x2400 for CogVideoX1.5, whose config says sample_height=300.
VARIANT_DEFAULTS = {
    "1.0": {"height": 480, "width": 720, "num_frames": 49, "fps": 8},
    "1.5": {"height": 768, "width": 1360, "num_frames": 81, "fps": 16},
}
COMMON_DEFAULTS = {"num_inference_steps": 50, "guidance_scale": 6.0}
# One sample's activations at a block's peak, in copies of its [video tokens, width] hidden states: (every
# tp device's, split over tp), fitted to the TPU compiler's temporaries (docs/planning.md).
ACTIVATION_COPIES = (0.7, 32.0)


def variant(transformer_config: dict[str, Any]) -> str:
    """CogVideoX 1.5 patches time (patch_size_t); 1.0 does not."""
    return "1.0" if transformer_config.get("patch_size_t") is None else "1.5"


def request_defaults(source) -> dict[str, Any]:
    version = variant(source.load_config("transformer"))
    return {**VARIANT_DEFAULTS[version], **COMMON_DEFAULTS, **source.preset_defaults}


@dataclass(frozen=True)
class Geometry:
    """How pixels map to latents and tokens for one model."""

    spatial: int  # VAE downsampling of height and width
    temporal: int  # VAE downsampling of frames
    patch: int
    patch_t: int | None
    text_tokens: int

    @classmethod
    def of(cls, source) -> Geometry:
        transformer = source.load_config("transformer")
        vae = source.load_config("vae")
        return cls(
            spatial=2 ** (len(vae["block_out_channels"]) - 1),
            temporal=vae["temporal_compression_ratio"],
            patch=transformer["patch_size"],
            patch_t=transformer.get("patch_size_t"),
            text_tokens=transformer["max_text_seq_length"],
        )


def video_tokens(source, request: Request) -> int:
    """The transformer's video tokens for the request (CogVideoX 1.5 pads the latent frames to whole
    temporal patches, as the pipeline does)."""
    geometry = Geometry.of(source)
    frames = (request.num_frames - 1) // geometry.temporal + 1
    frames = math.ceil(frames / geometry.patch_t) if geometry.patch_t else frames
    cells = geometry.spatial * geometry.patch
    return frames * (request.height // cells) * (request.width // cells)


def activations(source, request: Request, dtype: torch.dtype):
    """One sample's activation estimate for the default mesh (runtime.mesh.Activations)."""
    return common.activations(source, video_tokens(source, request), dtype, ACTIVATION_COPIES)


def validate_request(source, request: Request) -> None:
    """Reject what the VAE, the patching or the positional embeddings cannot take, before loading weights."""
    geometry = Geometry.of(source)
    size_step = geometry.spatial * geometry.patch
    for key in ("height", "width"):
        value = getattr(request, key)
        if value <= 0 or value % size_step:
            raise UserError(
                f"--{key} {value} must be a positive multiple of {size_step} "
                f"(VAE downsampling {geometry.spatial} x patch size {geometry.patch})"
            )
    frames = request.num_frames
    # The VAE turns k latent frames into 4(k-1)+1 frames only when k is odd (an even k decodes to 4k),
    # so the frame counts that round-trip are 8n+1; (F-1)/4+1 is the latent frame count.
    frame_step = 2 * geometry.temporal
    if frames < 1 or (frames - 1) % frame_step:
        raise UserError(
            f"--num_frames {frames} must be {frame_step}n+1 (e.g. 49 or 81): the VAE compresses time by "
            f"{geometry.temporal} and decodes only an odd number of latent frames back to that count"
        )
    transformer = source.load_config("transformer")
    if transformer.get("use_learned_positional_embeddings"):
        expected = (
            transformer["sample_height"] * geometry.spatial,
            transformer["sample_width"] * geometry.spatial,
            transformer["sample_frames"],
        )
        if (request.height, request.width, frames) != expected:
            raise UserError(
                "this model has learned positional embeddings and only takes "
                f"--height {expected[0]} --width {expected[1]} --num_frames {expected[2]}"
            )
    if transformer.get("use_rotary_positional_embeddings") and geometry.patch_t is not None:
        # CogVideoX 1.5's rotary table is cut from a grid of the config's sample size (diffusers' "slice"
        # grid): a larger video fails inside the pipeline's rotary embeddings (a shape error in torch.cat)
        for key in ("height", "width"):
            limit = transformer[f"sample_{key}"] // geometry.patch * size_step
            if getattr(request, key) > limit:
                raise UserError(
                    f"--{key} {getattr(request, key)} is over {limit}, the most this model's rotary embeddings "
                    f"cover (its config's sample_{key} {transformer[f'sample_{key}']} latents)"
                )
    if request.flow_shift is not None:
        raise UserError("--flow_shift applies to flow-matching models (HunyuanVideo-1.5), not CogVideoX")


def cfg_enabled(guidance_scale: float) -> bool:
    """CogVideoXPipeline runs the unconditional branch only for a guidance scale above 1."""
    return guidance_scale > 1.0


def guidance_branches(source, request) -> int:
    """The samples one step of one video runs: both CFG branches, or the conditional one."""
    return 2 if cfg_enabled(request.guidance_scale) else 1
