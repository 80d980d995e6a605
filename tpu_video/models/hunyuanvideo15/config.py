"""HunyuanVideo-1.5's facts and request rules: the documented defaults (by the transformer's target size), what
the VAE and the guider accept, checked before any weights load."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tpu_video.cli import UserError
from utils import Request

from .. import common
from . import i2v

LORA_LOADER = None  # diffusers 0.42.1 has no loader for 1.5: files must hold diffusers/PEFT keys
STEP_CACHES = ("magcache", "interval")  # the --cache kinds it runs (docs/caching.md)

# The pipeline's documented text-to-video defaults; the transformer's `target_size` says 480p or 720p.
RESOLUTION_DEFAULTS = {
    640: {"height": 480, "width": 848, "flow_shift": 5.0},
    960: {"height": 720, "width": 1280, "flow_shift": 9.0},
}
COMMON_DEFAULTS = {"num_frames": 121, "fps": 24, "num_inference_steps": 50, "guidance_scale": 6.0}
# One sample's activations at a block's peak, in copies of its [video tokens, width] hidden states: (every
# tp device's, split over tp), fitted to the TPU compiler's temporaries (docs/planning.md).
ACTIVATION_COPIES = (1.0, 26.0)


def request_defaults(source) -> dict[str, Any]:
    target = source.load_config("transformer").get("target_size", 640)
    resolution = RESOLUTION_DEFAULTS.get(target, RESOLUTION_DEFAULTS[640])
    guidance = source.load_config("guider").get("guidance_scale", COMMON_DEFAULTS["guidance_scale"])
    if i2v.image_to_video(source):  # its folders' shift (720p: 7.0, not t2v's 9.0); size from the image
        resolution = {**resolution, "flow_shift": common.folder_flow_shift(source)}
    return {**COMMON_DEFAULTS, **resolution, "guidance_scale": guidance, **source.preset_defaults}


@dataclass(frozen=True)
class Geometry:
    spatial: int
    temporal: int
    latent_channels: int

    @classmethod
    def of(cls, source) -> Geometry:
        vae = source.load_config("vae")
        return cls(
            spatial=vae["spatial_compression_ratio"],
            temporal=vae["temporal_compression_ratio"],
            latent_channels=vae["latent_channels"],
        )


def activations(source, request: Request, dtype: torch.dtype):
    """One sample's activation estimate for the default mesh (runtime.mesh.Activations)."""
    geometry = Geometry.of(source)
    transformer = source.load_config("transformer")
    frames = ((request.num_frames - 1) // geometry.temporal + 1) // transformer["patch_size_t"]
    cells = geometry.spatial * transformer["patch_size"]
    tokens = frames * (request.height // cells) * (request.width // cells)
    return common.activations(source, tokens, dtype, ACTIVATION_COPIES)


def validate_request(source, request: Request) -> None:
    geometry = Geometry.of(source)
    for key in ("height", "width"):
        value = getattr(request, key)
        if value <= 0 or value % geometry.spatial:
            raise UserError(f"--{key} {value} must be a positive multiple of {geometry.spatial}")
    frames = request.num_frames
    if frames < 1 or (frames - 1) % geometry.temporal:
        raise UserError(f"--num_frames {frames} must be {geometry.temporal}n+1 (e.g. 121)")
    if request.flow_shift is None or request.flow_shift <= 0:
        raise UserError(f"--flow_shift {request.flow_shift} must be positive")
    guider = source.load_config("guider")
    if (guider.get("start", 0.0), guider.get("stop", 1.0)) != (0.0, 1.0):
        raise UserError("this model's guider limits CFG to part of the schedule (start/stop); not supported yet")


def cfg_enabled(guidance_scale: float) -> bool:
    """The pipeline's guider runs the unconditional branch unless the scale is 1 (its default formulation)."""
    return not math.isclose(guidance_scale, 1.0)


def guidance_branches(source, request) -> int:
    """The samples one step of one video runs: both CFG branches, or the conditional one."""
    return 2 if cfg_enabled(request.guidance_scale) else 1
