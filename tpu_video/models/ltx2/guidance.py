"""LTX-2's guidance, resolved once per run: which of LTX2Pipeline's transformer passes run (the CFG pair,
spatio-temporal guidance, modality isolation) with which scales per stream, and what is skipped and why.

The pipeline's rules, with two departures that the docs state: an audio scale given as 0 means 0 (the
pipeline's `audio_scale or video_scale` would take the video's), and a default term that cannot change
the result is skipped rather than run: spatio-temporal guidance on a transformer without perturbed
attention (LTX-2.0) or whose default STG blocks lie beyond its depth, where the pipeline's extra pass
equals the conditional one. A term the user asked for that cannot act is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpu_video.cli import UserError

# LTX2Pipeline.__call__'s defaults.
DEFAULTS = {
    "stg_scale": 1.0,
    "modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_scale": 7.0,
    "audio_stg_scale": 1.0,
    "audio_modality_scale": 3.0,
    "audio_guidance_rescale": 0.7,
    "motion_speed": 1.0,
}
DEFAULT_STG_BLOCKS = (28,)


@dataclass(frozen=True)
class StreamScales:
    """One stream's (video or audio) guidance scales."""

    cfg: float
    stg: float
    modality: float
    rescale: float


@dataclass(frozen=True)
class Guidance:
    """The passes one denoising step runs, in batch order (`uncond`, `cond`, `stg`, `isolated`), and the
    scales that combine them in x0 space."""

    video: StreamScales
    audio: StreamScales
    branches: tuple[str, ...]
    stg_blocks: tuple[int, ...]
    motion_speed: float
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def cfg(self) -> bool:
        return "uncond" in self.branches

    def record(self) -> dict[str, Any]:
        return {
            "branches": list(self.branches),
            "video": vars(self.video),
            "audio": vars(self.audio),
            "stg_blocks": list(self.stg_blocks),
            "motion_speed": self.motion_speed,
            "skipped": self.skipped,
        }


def parse_blocks(text: str) -> tuple[int, ...]:
    try:
        blocks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--stg_blocks {text!r} must be comma-separated block indices, e.g. 28 or 20,28") from None
    if any(block < 0 for block in blocks):
        raise UserError(f"--stg_blocks {text!r}: block indices are never negative")
    return blocks


def resolve_guidance(request, transformer_config: dict[str, Any]) -> Guidance:
    """The run's guidance from the request (None: the pipeline's default) and the transformer's config."""
    value = {key: request.option(key) if request.option(key) is not None else DEFAULTS[key] for key in DEFAULTS}
    video = StreamScales(request.guidance_scale, value["stg_scale"], value["modality_scale"], value["guidance_rescale"])
    audio = StreamScales(
        value["audio_guidance_scale"],
        value["audio_stg_scale"],
        value["audio_modality_scale"],
        value["audio_guidance_rescale"],
    )
    if value["motion_speed"] <= 0:
        raise UserError(f"--motion_speed {value['motion_speed']} must be positive")
    for name, scale in (("guidance_rescale", video.rescale), ("audio_guidance_rescale", audio.rescale)):
        if not 0 <= scale <= 1:
            raise UserError(f"--{name} {scale} must be from 0 to 1")
    given_blocks = request.option("stg_blocks") is not None
    blocks = parse_blocks(request.option("stg_blocks")) if given_blocks else DEFAULT_STG_BLOCKS
    depth = transformer_config["num_layers"]
    skipped: dict[str, str] = {}
    branches = ["uncond"] if video.cfg > 1.0 or audio.cfg > 1.0 else []
    branches.append("cond")
    if video.stg > 0.0 or audio.stg > 0.0:
        stg_given = (
            given_blocks or request.option("stg_scale") is not None or request.option("audio_stg_scale") is not None
        )
        beyond = [block for block in blocks if block >= depth]
        if not blocks:
            raise UserError(
                "--stg_blocks is empty but the STG scales are positive; pass --stg_scale 0 --audio_stg_scale 0"
            )
        if not transformer_config.get("perturbed_attn", False):
            why = "the transformer has no perturbed attention (LTX-2.0): the pass would equal the conditional one"
            if stg_given:
                raise UserError(f"spatio-temporal guidance cannot act: {why}; pass --stg_scale 0 --audio_stg_scale 0")
            skipped["stg"] = why
        elif beyond and given_blocks:
            raise UserError(
                f"--stg_blocks {request.option('stg_blocks')}: the transformer has {depth} blocks (0 to {depth - 1})"
            )
        elif len(beyond) == len(blocks):
            skipped["stg"] = f"the default STG blocks {list(blocks)} lie beyond the transformer's {depth} blocks"
        else:
            branches.append("stg")
    elif given_blocks:
        raise UserError(
            f"--stg_blocks {request.option('stg_blocks')}: spatio-temporal guidance is off (both STG scales are 0)"
        )
    if video.modality > 1.0 or audio.modality > 1.0:
        branches.append("isolated")
    stg_blocks = tuple(block for block in blocks if block < depth) if "stg" in branches else ()
    return Guidance(video, audio, tuple(branches), stg_blocks, value["motion_speed"], skipped)
