"""LTX-2.5's duration head: where stage 1 is not given `--num_frames`, it picks the video's length from the
prompt's connector outputs, as `LTX2Pipeline` does when called without `num_frames` (the positive prompt's video
and audio tokens, the pipeline's default bounds of 1 to 20 seconds, snapped to the VAE's 8n+1 frames)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpu_video.cli import log
from utils import Request

from .config import has_duration_head, vae_ratios

# LTX2Pipeline.__call__'s bounds on the predicted duration.
MIN_SECONDS, MAX_SECONDS = 1.0, 20.0


def frames_from_prompt(source) -> Callable[[Request, dict[str, torch.Tensor]], int] | None:
    """None for checkpoints without a duration head; else a function of a request and its stage-1 tensors
    giving the frame count (the head loaded on first use, once per stage 1)."""
    if not has_duration_head(source):
        return None
    loaded: list[torch.nn.Module] = []

    def predict(request: Request, embeddings: dict[str, torch.Tensor]) -> int:
        if not loaded:
            loaded.append(source.load("duration_head", dtype=embeddings["connector_prompt_embeds"].dtype).eval())
        with torch.no_grad():
            frames = loaded[0].predict_num_frames(
                embeddings["connector_prompt_embeds"],
                embeddings["connector_audio_prompt_embeds"],
                frame_rate=float(request.fps),
                temporal_compression_ratio=vae_ratios(source)[1],
                min_seconds=MIN_SECONDS,
                max_seconds=MAX_SECONDS,
            )
        log(f"the duration head chose {frames} frames ({frames / request.fps:.2f} s at {request.fps} fps)")
        return frames

    return predict
