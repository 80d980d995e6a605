"""Wan 2.1 and 2.2's facts and request rules: the pipeline's defaults, one transformer or two experts, and what
the VAE, the patching and the rotary embedding accept (checked before any weights load)."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError
from utils import Request

from .. import common
from ..common import folder_flow_shift
from . import animate, ti2v, vace
from .declarations import DEFAULT_STRENGTH, PIPELINE_CLASSES

LORA_LOADER = "WanLoraLoaderMixin"  # reads adapter files and converts the original Wan and musubi formats
STEP_CACHES = ("magcache", "interval")  # the --cache kinds it runs (docs/caching.md)
# WanPipeline.__call__'s defaults (480p; the 14B models also run 720p: --height 720 --width 1280).
DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "fps": 16, "num_inference_steps": 50, "guidance_scale": 5.0}
# One sample's activations at a block's peak, in copies of its [video tokens, width] hidden states: (every
# tp device's, split over tp), fitted to the TPU compiler's temporaries (docs/planning.md). TI2V-5B adds
# float32 copies: its per-token modulation, [tokens, 6, width], and the float32 arithmetic it feeds (one
# block's at a time: the block barrier).
ACTIVATION_COPIES = (4.8, 16.5)
TI2V_FP32_COPIES = 14.5


def request_defaults(source) -> dict[str, Any]:
    """The pipeline's defaults (Animate's own); the flow shift as the folder's scheduler records it."""
    defaults = {**DEFAULTS, **animate.DEFAULTS} if animate.is_animate(source) else DEFAULTS
    return {**defaults, "flow_shift": folder_flow_shift(source), **source.preset_defaults}


def transformer_components(source) -> tuple[str, ...]:
    """The transformers this pipeline runs: one, or Wan 2.2's two experts (high noise first)."""
    return ("transformer", "transformer_2") if source.index.get("boundary_ratio") is not None else ("transformer",)


def depth_overrides(source, component: str, num_layers: int) -> dict[str, Any]:
    """A transformer config at `num_layers` blocks: a VACE transformer's hint layers index its blocks, so those
    past the depth go too. Animate builds num_layers // inject_face_latents_blocks face adapters and calls one after
    every inject-th block from block 0: a depth that is no multiple of it gets one, after its first block."""
    overrides: dict[str, Any] = {"num_layers": num_layers}
    config = source.load_config(component)
    if config.get("vace_layers") is not None:
        overrides["vace_layers"] = [layer for layer in config["vace_layers"] if layer < num_layers]
    every = config.get("inject_face_latents_blocks")
    if every is not None and num_layers % every:  # fewer adapters than the blocks that call one: one, after block 0
        overrides["inject_face_latents_blocks"] = num_layers
    return overrides


def validate_request(source, request: Request) -> None:
    two_experts = source.index.get("boundary_ratio") is not None
    if two_experts and not isinstance(source.index.get("transformer_2"), list):
        raise UserError(f"--model {source.ref!r} sets boundary_ratio but has no transformer_2")
    if request.option("guidance_scale_2") is not None and not two_experts:
        raise UserError("--guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this one has one transformer")
    vae = source.load_config("vae")
    patch = source.load_config("transformer")["patch_size"]
    spatial, temporal = vae["scale_factor_spatial"], vae["scale_factor_temporal"]
    for key, multiple in (("height", spatial * patch[1]), ("width", spatial * patch[2])):
        value = getattr(request, key)
        if value <= 0 or value % multiple:
            raise UserError(f"--{key} {value} must be a positive multiple of {multiple}")
    if animate.is_animate(source):  # any length: the segment is 4n+1 frames, the pose video padded to it
        animate.check_request(source, request)
    elif request.num_frames < 1 or (request.num_frames - 1) % temporal:
        raise UserError(f"--num_frames {request.num_frames} must be {temporal}n+1 (e.g. 81)")
    # The rotary embedding holds rope_max_seq_len positions per axis (diffusers' WanRotaryPosEmbed).
    positions = source.load_config("transformer").get("rope_max_seq_len", 1024)
    frames = ("segment_frame_length", animate.segment_options(request)[0]) if animate.is_animate(source) else None
    given = (frames or ("num_frames", request.num_frames), ("height", request.height), ("width", request.width))
    for (key, value), count in zip(given, token_grid(source, request), strict=True):
        if count > positions:
            raise UserError(
                f"--{key} {value} makes {count} token positions along it, more than the "
                f"{positions} the transformer's rotary embedding holds (rope_max_seq_len)"
            )
    vace.check_request(source, request)
    if request.flow_shift is None or request.flow_shift <= 0:
        raise UserError(f"--flow_shift {request.flow_shift} must be positive")
    strength = request.option("strength")  # stored whenever stage 1 had --video: checked in every stage
    if strength is not None and not 0 < strength <= 1:
        raise UserError(f"--strength {strength} must be above 0 and at most 1 (1: every step, from pure noise)")
    if strength is not None and strength_steps(request)[1] < 1:
        raise UserError(
            f"--strength {strength} of {request.num_inference_steps} steps runs none (int(steps x strength) is "
            "0); give a larger --strength or more --num_inference_steps"
        )


def strength_steps(request: Request) -> tuple[int, int]:
    """Video-to-video: (the first step of the schedule the run starts at, how many it runs), as the pipeline's
    get_timesteps computes them."""
    steps = request.num_inference_steps
    strength = DEFAULT_STRENGTH if request.option("strength") is None else request.option("strength")
    init = min(int(steps * strength), steps)
    return max(steps - init, 0), init


def denoise_steps(source, request: Request, task: str) -> int:
    """Family.denoise_steps: video-to-video runs the last `int(steps x strength)` steps, the rest every step."""
    return strength_steps(request)[1] if task == "v2v" else request.num_inference_steps


def token_grid(source, request: Request) -> tuple[int, int, int]:
    """The transformer's token positions along frames, height and width for the request's video."""
    vae = source.load_config("vae")
    patch = source.load_config("transformer")["patch_size"]
    spatial, temporal = vae["scale_factor_spatial"], vae["scale_factor_temporal"]
    latent_frames = (request.num_frames - 1) // temporal + 1
    if animate.is_animate(source):  # the segment's, and the character's frame
        latent_frames = animate.latent_frames(source, request)
    return latent_frames // patch[0], request.height // (spatial * patch[1]), request.width // (spatial * patch[2])


def activations(source, request: Request, dtype: torch.dtype):
    """One sample's activation estimate for the default mesh (runtime.mesh.Activations)."""
    frames, height, width = token_grid(source, request)
    fp32 = TI2V_FP32_COPIES if ti2v.expand_timesteps(source) else 0
    return common.activations(source, frames * height * width, dtype, ACTIVATION_COPIES, fp32)


def cfg_enabled(guidance_scale: float) -> bool:
    """WanPipeline runs the unconditional branch for a (first) guidance scale above 1."""
    return guidance_scale > 1.0


def guidance_branches(source, request) -> int:
    """The samples one step of one video runs: both CFG branches, or the conditional one."""
    return 2 if cfg_enabled(request.guidance_scale) else 1


def image_to_video(source) -> bool:
    return source.index.get("_class_name") == "WanImageToVideoPipeline"


def stock_pipeline(source, **components):
    """The source's pipeline (WanPipeline, WanImageToVideoPipeline, WanVACEPipeline or WanAnimatePipeline)
    holding only the given components, with the source's VAE geometry."""
    import diffusers

    names = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer", "transformer_2")
    if image_to_video(source):
        names += ("image_encoder", "image_processor")
    if animate.is_animate(source):  # one transformer, a CLIP encoder
        names = (*names[:5], "image_encoder", "image_processor")
    known = source.index.get("_class_name")
    cls = getattr(diffusers, known if known in PIPELINE_CLASSES else "WanPipeline")
    pipe = cls(**{**dict.fromkeys(names), **components})
    vae = source.load_config("vae")
    pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = (
        vae["scale_factor_spatial"],
        vae["scale_factor_temporal"],
    )
    return pipe
