"""LTX-2's latent spaces: both VAEs' statistics read from the checkpoint, the de-normalisation stage 2 applies
after its loop (as LTX2Pipeline does), what stage 2 records about it, the upgrade of folders written before
2026-11-27, the normalisation of a later pass's given latents, and stage 3's video decode."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from tpu_video.cli import UserError, log

from .config import vae_ratios


def latent_statistics(source, component: str, planning: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A VAE's `latents_mean` and `latents_std` buffers (the pipeline's de-normalisation), read from its
    checkpoint without loading the VAE. `planning` (--plan, or a configs-only source, which has no values):
    zeros and ones of the buffers' shape. Never inferred from a module's parameters: placed torchax weights
    and directly loaded ones report `is_meta` in every real run."""
    from tpu_video.engine.meta import meta_module

    if planning or source.configs_only:
        shape = meta_module(source, component, torch.float32).latents_mean.shape
        return torch.zeros(shape), torch.ones(shape)

    found = _checkpoint_statistics(source.location, component)
    if found is not None:
        return found
    vae = source.load(component)
    return vae.latents_mean.float(), vae.latents_std.float()


@functools.lru_cache(maxsize=8)
def _checkpoint_statistics(location: str, component: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The buffers as the component's safetensors files hold them (None: not there), read once per process:
    every video of a stage-2 batch builds its loop, and so asks again."""
    from safetensors import safe_open

    from tpu_video.engine.direct_load import checkpoint_paths

    try:
        paths = checkpoint_paths(location, component)
    except OSError:
        paths = []
    for path in paths:
        with safe_open(path, framework="pt") as file:
            if "latents_mean" in file.keys():
                return file.get_tensor("latents_mean").float(), file.get_tensor("latents_std").float()
    return None


@dataclasses.dataclass(frozen=True)
class VaeStatistics:
    """What de-normalising takes: both VAEs' statistics and the video VAE's scaling factor."""

    video_mean: torch.Tensor
    video_std: torch.Tensor
    scaling_factor: float
    audio_mean: torch.Tensor
    audio_std: torch.Tensor


def vae_statistics(source, planning: bool) -> VaeStatistics:
    """Read once, before a denoise starts (a folder without the VAEs' files fails then, not after the loop)."""
    video_mean, video_std = latent_statistics(source, "vae", planning)
    audio_mean, audio_std = latent_statistics(source, "audio_vae", planning)
    scaling = source.load_config("vae").get("scaling_factor", 1.0)
    return VaeStatistics(video_mean, video_std, scaling, audio_mean, audio_std)


def denormalized(tensors: dict[str, torch.Tensor], statistics: VaeStatistics) -> dict[str, torch.Tensor]:
    """Stage 2's `latents` (B, C, F, H, W) and `audio_latents` (B, C, L, M), normalised as the transformer
    denoises them, de-normalised to their VAEs' spaces as LTX2Pipeline does after its loop (the audio on its
    packed features, the video with the VAE's scaling factor), in float32."""
    from diffusers import LTX2Pipeline

    s = statistics
    video = LTX2Pipeline._denormalize_latents(tensors["latents"].float(), s.video_mean, s.video_std, s.scaling_factor)
    audio = tensors["audio_latents"].float()
    packed = LTX2Pipeline._denormalize_audio_latents(LTX2Pipeline._pack_audio_latents(audio), s.audio_mean, s.audio_std)
    audio = LTX2Pipeline._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=audio.shape[3])
    return {**tensors, "latents": video, "audio_latents": audio}


def normalized(tensors: dict[str, torch.Tensor], statistics: VaeStatistics):
    """The inverse of `denormalized`: stage-2 `latents` and `audio_latents` as the pipelines' prepare_latents
    and prepare_audio_latents take given ones, in float32: the video normalised, still (B, C, F, H, W); the
    audio packed, then normalised (1, length, features)."""
    from diffusers import LTX2Pipeline

    s = statistics
    video = LTX2Pipeline._normalize_latents(tensors["latents"].float(), s.video_mean, s.video_std, s.scaling_factor)
    audio = LTX2Pipeline._pack_audio_latents(tensors["audio_latents"].float())
    return video, LTX2Pipeline._normalize_audio_latents(audio, s.audio_mean, s.audio_std)


# Marks a stage-2 section whose latents stage 2 de-normalised itself. Sections without it (written before
# 2026-11-27) hold what that stage 2 wrote: it read the statistics as zeros and ones in every real run but
# still divided the video by the scaling factor, so its video latents are the transformer's over the scaling
# factor and its audio latents the transformer's. De-normalising them with the real statistics and the video's
# scaling taken as 1 is exactly what a fixed stage 2 computes.
DENORMALIZED = "vae_statistics_applied"


def latents_normalization(source) -> dict[str, Any]:
    """Stage 2's latents are already in the VAEs' spaces (the pipeline's output_type="latent")."""
    return {"method": "none", DENORMALIZED: True}


def upgrade_stage2(source, tensors: dict[str, torch.Tensor], normalization: dict[str, Any]):
    """Stage 3's view of a stage-2 section: one written before the fix (unmarked) is de-normalised here, with
    a log line, and then reads as a fixed one."""
    if normalization.get("method") != "none" or normalization.get(DENORMALIZED):
        return tensors, normalization
    log(
        "stage 2 of this folder predates 2026-11-27 and stored normalised LTX-2 latents: de-normalising them "
        "with the VAEs' statistics (exact; rerunning stage 2 writes them de-normalised)"
    )
    statistics = dataclasses.replace(vae_statistics(source, planning=False), scaling_factor=1.0)
    return denormalized(tensors, statistics), latents_normalization(source)


class Decoder(torch.nn.Module):
    """The video VAE's decode of stage 2's (already de-normalised) latents, as LTX2Pipeline decodes them.

    A VAE with timestep conditioning is decoded at the pipeline's default `decode_timestep` 0, whose noise
    scale (`decode_noise_scale`, defaulting to the timestep) is 0: the pipeline's noise draw then adds
    exactly nothing to the latents, so stage 3 need not draw it."""

    DECODE_TIMESTEP = 0.0

    def __init__(self, vae: torch.nn.Module, normalization: dict[str, Any]) -> None:
        super().__init__()
        if normalization.get("method") != "none" or not normalization.get(DENORMALIZED):
            raise UserError(f"LTX-2 latents are stored de-normalised; stage 2 recorded {normalization}")
        self.vae = vae

    def forward(self, latents):
        latents = latents.to(next(self.vae.parameters()).dtype)
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.full((latents.shape[0],), self.DECODE_TIMESTEP, dtype=latents.dtype, device=latents.device)
        return self.vae.decode(latents, timestep, return_dict=False)[0]


def video_processor(source):
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=vae_ratios(source)[0])
