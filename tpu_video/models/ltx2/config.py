"""LTX-2's facts and request rules: the pipeline's defaults, what the VAEs
and the transformer accept (checked before any weights load), and the stock pipeline object its stages call.

LTX-2.5 (a Gemma 4 text encoder, a duration head, prompt modulation by a fixed table) runs through the same
pipelines; its prompt enhancer is not run (the pipeline runs it only when asked).
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError
from utils import Request

from .. import common
from .declarations import text_encoder_class

LORA_LOADER = "LTX2LoraLoaderMixin"  # its lora_state_dict converts the original LTX-2 keys (diffusion_model.*)
# --cache kinds: the interval cache only. diffusers 0.42.1 has no MagCache for LTX-2 (its blocks are not in
# the cache hooks' registry), so there is no reference to be exact to, and a MagCache skip would pass the
# audio stream through its skipped blocks unchanged, as it passes text tokens.
STEP_CACHES = ("interval",)
# LTX2Pipeline.__call__'s defaults (num_frames: its fixed default for checkpoints without a duration head).
DEFAULTS = {"height": 512, "width": 768, "num_frames": 121, "fps": 24, "num_inference_steps": 30, "guidance_scale": 3.0}
MAX_SEQUENCE_LENGTH = 1024  # the pipeline's Gemma prompt layout: left padding to 1024 tokens
TOKENIZER_PADDING_SIDE = "left"
# One sample's activations at a block's peak, in copies of its [video tokens, width] hidden states (whole,
# split over tp), fitted to the TPU compiler's temporaries of LTX-2.0 and LTX-2.3 at or above each
# (docs/planning.md#the-activation-estimate): exact on LTX-2.0's unrolled 1 x 1 x 8 and LTX-2.3's 4 x 1 x 2,
# up to 1.63x over the others (the scanned programs need less, and one linear model serves both versions).
ACTIVATION_COPIES = (4.72, 5.24)
TEXT_ENCODERS = ("Gemma3ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")
SUPPORTED = "LTX-2.0 and LTX-2.3 (Gemma 3 text encoder), LTX-2.5 (Gemma 4)"


def request_defaults(source) -> dict[str, Any]:
    return {**DEFAULTS, **source.preset_defaults}  # image_crf: its input default (declarations.py)


def image_to_video(source) -> bool:
    return source.index.get("_class_name") == "LTX2ImageToVideoPipeline"


def transformer_components(source) -> tuple[str, ...]:
    return ("transformer",)


def check_release(source) -> None:
    """Refuse a text encoder this family does not run (LTX-2.0 and 2.3 take Gemma 3, LTX-2.5 Gemma 4)."""
    encoder = text_encoder_class(source)
    if encoder not in TEXT_ENCODERS:
        raise UserError(f"--model {source.ref!r} has the text encoder {encoder}; supported: {SUPPORTED}")


def has_component(source, name: str) -> bool:
    """Whether the folder holds one of the pipelines' optional components (model_index.json names unset ones
    with nulls)."""
    return bool((source.index.get(name) or [None])[0])


def has_duration_head(source) -> bool:
    """LTX-2.5's duration head: it picks the frame count from the prompt where --num_frames is not given."""
    return has_component(source, "duration_head")


def validate_request(source, request: Request) -> None:
    from .guidance import resolve_guidance

    check_release(source)
    for key in ("height", "width"):
        value = getattr(request, key)
        if value <= 0 or value % 32:
            raise UserError(f"--{key} {value} must be a positive multiple of 32 (LTX2Pipeline's rule)")
    temporal = vae_ratios(source)[1]
    if request.num_frames < 1 or (request.num_frames - 1) % temporal:
        raise UserError(f"--num_frames {request.num_frames} must be {temporal}n+1 (e.g. 121)")
    crf = request.option("image_crf")
    if crf is not None and not 0 <= crf <= 51:
        raise UserError(f"--image_crf {crf} must be from 0 (no re-encode) to 51 (H.264's range)")
    if request.flow_shift is not None:
        raise UserError("--flow_shift: LTX-2's scheduler shifts by the video's token count (dynamic shifting)")
    check_schedule(request)
    check_placements(request, latent_grid(source, request)[0])
    resolve_guidance(request, source.load_config("transformer"))


def check_placements(request: Request, latent_frames: int) -> None:
    """Conditions (conditions.py), before any weights load: each index inside the video's latent frames (the
    pipeline would drop the condition with a warning), each strength a fraction."""
    for index in request.option("condition_index") or ():
        if not -latent_frames <= index < latent_frames:
            raise UserError(
                f"--condition_index {index}: the video has {latent_frames} latent frames (-{latent_frames} to "
                f"{latent_frames - 1}; --num_frames {request.num_frames})"
            )
    for strength in request.option("condition_strength") or ():
        if not 0 <= strength <= 1:
            raise UserError(f"--condition_strength {strength} must be from 0 (not held) to 1 (kept as given)")


def schedule_sigmas(request: Request) -> list[float] | None:
    """The sigmas `--sigmas` names (diffusers' own lists), or None for the pipeline's evenly spaced ones."""
    name = request.option("sigmas")
    if name is None:
        return None
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES, STAGE_2_DISTILLED_SIGMA_VALUES

    return list({"distilled": DISTILLED_SIGMA_VALUES, "distilled_refine": STAGE_2_DISTILLED_SIGMA_VALUES}[name])


def scheduler_config(source, request: Request) -> dict[str, Any]:
    """The scheduler's config for this request: the folder's, or with `--sigma_shift none` its dynamic shift
    and terminal stretch off (the sigmas then run as given, the scheduler's `shift` aside)."""
    config = dict(source.load_config("scheduler"))
    if request.option("sigma_shift") == "none":
        config.update(use_dynamic_shifting=False, shift_terminal=None)
    return config


def check_schedule(request: Request) -> None:
    """A named schedule fixes the step count; the noise scale is a fraction."""
    noise_scale = request.option("noise_scale")
    if noise_scale is not None and not 0 <= noise_scale <= 1:
        raise UserError(f"--noise_scale {noise_scale} must be from 0 (the latents as given) to 1 (pure noise)")
    name, sigmas = request.option("sigmas"), schedule_sigmas(request)
    if sigmas is not None and request.num_inference_steps != len(sigmas):
        raise UserError(
            f"--sigmas {name} is {len(sigmas)} steps; --num_inference_steps {request.num_inference_steps} differs "
            "(leave it out: stage 1's --sigmas sets it)"
        )


def vae_ratios(source) -> tuple[int, int]:
    """The video VAE's (spatial, temporal) compression from its config alone (AutoencoderKLLTX2Video's rule)."""
    vae = source.load_config("vae")
    scaling = vae.get("spatio_temporal_scaling", (True, True, True, True))
    if isinstance(scaling, bool):
        scaling = (scaling,) * (len(vae.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
    spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2 ** sum(scaling)
    temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** sum(scaling)
    return spatial, temporal


def latent_grid(source, request: Request) -> tuple[int, int, int]:
    """The video latents' (frames, height, width), as the pipeline's prepare_latents computes them."""
    spatial, temporal = vae_ratios(source)
    return (request.num_frames - 1) // temporal + 1, request.height // spatial, request.width // spatial


def audio_frames(source, request: Request) -> int:
    """The audio latents' length: the video's duration at the audio VAE's latent rate (the pipeline's
    expression, so the same rounding)."""
    audio = source.load_config("audio_vae")
    duration_s = request.num_frames / float(request.fps)
    per_second = audio["sample_rate"] / audio["mel_hop_length"] / float(audio_temporal_ratio(source))
    return round(duration_s * per_second)


def audio_temporal_ratio(source) -> int:
    """AutoencoderKLLTX2Audio's time compression (LATENT_DOWNSAMPLE_FACTOR in diffusers 0.42.1)."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    return LATENT_DOWNSAMPLE_FACTOR


def activations(source, request: Request, dtype: torch.dtype):
    frames, height, width = latent_grid(source, request)
    return common.activations(source, frames * height * width, dtype, ACTIVATION_COPIES)


def guidance_branches(source, request: Request) -> int:
    """The passes one step runs as one batch (guidance.py: CFG's two, STG, modality isolation): the default
    mesh puts them on `dp` where its size divides them."""
    from .guidance import resolve_guidance

    return len(resolve_guidance(request, source.load_config("transformer")).branches)


def stock_pipeline(source, pipeline=None, **components):
    """The source's pipeline (LTX2Pipeline or LTX2ImageToVideoPipeline; or `pipeline`, a class) holding only the
    given components (its static helpers, prompt encoding, video processor, conditions), with the VAE's ratios and
    the transformer's patch sizes read from their configs where those components are not given (the pipeline
    would take the published ones)."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline

    names = ("scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer", "vocoder")
    if pipeline is None:
        pipeline = LTX2ImageToVideoPipeline if image_to_video(source) else LTX2Pipeline
    pipe = pipeline(**{**dict.fromkeys(names), **components})
    if components.get("vae") is None:
        pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio = vae_ratios(source)
    if components.get("transformer") is None:
        transformer = source.load_config("transformer")
        pipe.transformer_spatial_patch_size = transformer["patch_size"]
        pipe.transformer_temporal_patch_size = transformer["patch_size_t"]
    return pipe
