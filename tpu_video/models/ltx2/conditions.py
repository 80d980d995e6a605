"""LTX-2's conditions (`LTX2ConditionPipeline`): images and clips placed at latent frames of a text-to-video
checkpoint's video, each held to with its strength (keyframes, first and last frame, a video extended).

Stage 1 prepares each condition with the pipeline's own `preprocess_conditions` (the H.264 round trip of a
one-frame condition at `--image_crf`, the bilinear resize and centre crop, a clip trimmed to the room after its
index) and writes its normalised VAE latents. Stage 2 builds the pipeline's initial latents from them (from
zeros, or in a pass from given latents from those): a condition at latent frame 0 replaces the first frames'
tokens, a later one is appended as keyframe tokens with positions of their own; each token's conditioning mask
(its strength) scales its timestep and its noise, and blends the guided prediction with the condition in x0
space (transformer.py); the appended tokens are dropped after the loop. Indices are the pipeline's: latent
frames, negative ones counted from the end.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from tpu_video.cli import UserError, log
from utils import Request

from .config import latent_grid, schedule_sigmas, stock_pipeline, vae_ratios
from .crf import check_h264_size
from .declarations import CONDITION
from .latents import latent_statistics

CONDITION_LATENTS = "condition_latents_{}"  # (1, C, frames, H/32, W/32) per condition, normalised


def placements(request: Request, count: int) -> list[tuple[int, float]]:
    """Each condition's (latent index as given, strength): the flags' values, one strength for all, or the
    pipeline's defaults (index 0 for a single condition, strength 1)."""
    indices, strengths = request.option("condition_index"), request.option("condition_strength")
    if indices is None:
        if count > 1:
            raise UserError(f"--condition: {count} conditions; give each its latent frame with --condition_index")
        indices = [0]
    strengths = [1.0] if strengths is None else strengths
    strengths = strengths * count if len(strengths) == 1 else strengths
    for flag, values, rule in (
        ("--condition_index", indices, "one for each"),
        ("--condition_strength", strengths, "one for all, or one for each"),
    ):
        if len(values) != count:
            raise UserError(f"{flag} has {len(values)} for {count} --condition paths; give {rule}")
    return list(zip(indices, strengths, strict=True))


def start_frame(index: int, latent_frames: int, temporal: int) -> int:
    """The pixel frame a condition at latent `index` starts at (the pipeline's rule)."""
    return max((index % latent_frames - 1) * temporal + 1, 0)


def check_conditions(source, request: Request, clips: list[list]) -> None:
    """Stage 1, before any weights load: one placement per clip, and each clip within the room after its start
    (the pipeline would cut it short; it still takes temporal x n + 1 of its frames, which is said)."""
    latent_frames, temporal = latent_grid(source, request)[0], vae_ratios(source)[1]
    for number, ((index, _), frames) in enumerate(zip(placements(request, len(clips)), clips, strict=True)):
        start = start_frame(index, latent_frames, temporal)
        room = request.num_frames - start
        if len(frames) > room:
            raise UserError(
                f"--condition {number + 1}: {len(frames)} frames from pixel frame {start} (--condition_index "
                f"{index}); the video has {request.num_frames}, so {room} fit"
            )
        usable = (len(frames) - 1) // temporal * temporal + 1
        if usable != len(frames):
            log(f"--condition {number + 1}: {len(frames)} frames; the model takes {temporal}n+1, so its first {usable}")
        if len(frames) == 1:
            check_h264_size(request.option("image_crf"), frames[0], f"--condition {number + 1}")
        width, height = frames[0].size
        if abs(width / height - request.width / request.height) > 0.01 * request.width / request.height:
            log(
                f"--condition {number + 1}: its {height}x{width} frames (height x width) are resized to cover "
                f"{request.height}x{request.width} and centre-cropped, as the pipeline does"
            )


def encode_conditions(source, request: Request, clips: list[list], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's `preprocess_conditions` of each clip (one frame: an image), then the float32 VAE's
    posterior mode (`sample_mode="argmax"`), normalised by the VAE's statistics without its scaling factor."""
    from diffusers import LTX2ConditionPipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    from tpu_video.engine.encoders import DeviceVAEEncoder

    vae = source.load("vae", dtype=torch.float32).eval()
    pipe = stock_pipeline(source, LTX2ConditionPipeline, vae=vae)
    crf = request.option("image_crf")
    conditions = [
        LTX2VideoCondition(frames=frames, index=index, strength=strength, crf=crf)
        for frames, (index, strength) in zip(clips, placements(request, len(clips)), strict=True)
    ]
    pixels, _, _, _ = pipe.preprocess_conditions(
        conditions, request.height, request.width, request.num_frames, device="cpu"
    )
    # From the checkpoint, not the module: placed (torchax) buffers cannot be used on the host, and --plan's VAE is
    # on the meta device.
    mean, std = latent_statistics(source, "vae")
    encoder = DeviceVAEEncoder(vae, runtime)
    tensors = {}
    for number, clip in enumerate(pixels):
        latents = encoder.encode(clip.float()).latent_dist.mode()
        tensors[CONDITION_LATENTS.format(number)] = pipe._normalize_latents(latents, mean, std).contiguous()
    return tensors


def condition_count(embeds) -> int:
    """How many conditions stage 1 wrote (their tensors are numbered from 0)."""
    return next(n for n in itertools.count() if CONDITION_LATENTS.format(n) not in embeds)


def planning_conditions(request: Request, channels: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """--plan of a conditioned stage-1 folder: a one-frame condition at each --condition_index its request holds
    (the clips' lengths are in its tensors, not its request; a single condition without an index is not
    planned)."""
    indices = request.option("condition_index") or ()
    return {CONDITION_LATENTS.format(n): torch.zeros(1, channels, 1, height, width) for n in range(len(indices))}


@dataclasses.dataclass(frozen=True)
class ConditionedVideo:
    """What LTX2ConditionPipeline's `prepare_latents` gives the loop."""

    latents: torch.Tensor  # (1, tokens, C): the video's packed latents, any keyframe tokens appended, noised
    mask: torch.Tensor  # (1, tokens): each token's strength (0: denoised freely)
    clean: torch.Tensor  # (1, tokens, C): the conditions' latents where held, zeros elsewhere
    keyframe_coords: torch.Tensor | None  # (1, 3, keyframe tokens, 2): the appended tokens' positions
    video_tokens: int  # the video's own tokens, before the keyframes'
    placed: str  # where each condition is held and how strongly, for the run's log


def noise_scale(request: Request, given: bool) -> float:
    """LTX2ConditionPipeline's `noise_scale`: --noise_scale where a pass from given latents gives it (a pass from
    noise refuses it), else the pipeline's default, the schedule's first sigma (1 for its own schedule), also
    when given latents."""
    if given and request.option("noise_scale") is not None:
        return request.option("noise_scale")
    sigmas = schedule_sigmas(request)
    return sigmas[0] if sigmas is not None else 1.0


def conditioned_video(
    source, request: Request, embeds, config: dict[str, Any], fps: float, generator, given: torch.Tensor | None = None
) -> ConditionedVideo | None:
    """LTX2ConditionPipeline's `prepare_latents` from stage 1's condition latents, the noise drawn from
    `generator`: from zeros, or with `latents=` from an earlier pass's latents (`given`: normalised, (1, C, F,
    H, W)), which the conditions then overwrite and the noise renoises around them; None without conditions."""
    from diffusers import LTX2ConditionPipeline
    from diffusers.utils.torch_utils import randn_tensor

    count = condition_count(embeds)
    if not count:
        return None
    frames, height, width = latent_grid(source, request)
    conditions = [embeds[CONDITION_LATENTS.format(n)].float() for n in range(count)]
    check_condition_size(conditions, height, width)
    pipe = stock_pipeline(source, LTX2ConditionPipeline)
    pack = pipe._pack_latents
    patch = (pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
    start = torch.zeros(1, config["in_channels"], frames, height, width) if given is None else given
    latents = pack(start, *patch)
    mask = pack(torch.zeros(1, 1, frames, height, width), *patch)
    packed = [pack(condition, *patch) for condition in conditions]
    indices, strengths = zip(*((index % frames, s) for index, s in placements(request, count)), strict=True)
    latents, mask, clean = pipe.apply_first_frame_conditioning(
        latents, mask, packed, strengths, indices, latent_height=height, latent_width=width
    )
    video_tokens = latents.shape[1]
    keyframes = [n for n, index in enumerate(indices) if index != 0]
    coords = None
    if keyframes:  # appended after the video's tokens, as the pipeline appends them
        temporal = pipe.vae_temporal_compression_ratio
        coords = torch.cat(
            [
                pipe._prepare_keyframe_coords(
                    *conditions[n].shape[2:],
                    pixel_frame_idx=(indices[n] - 1) * temporal + 1,
                    num_pixel_frames=(conditions[n].shape[2] - 1) * temporal + 1,
                    fps=fps,
                    device="cpu",
                )
                for n in keyframes
            ],
            dim=2,
        )
        latents = torch.cat([latents, *(packed[n] for n in keyframes)], dim=1)
        mask = torch.cat([mask, *(torch.full((1, packed[n].shape[1], 1), float(strengths[n])) for n in keyframes)], 1)
        clean = torch.cat([clean, *(packed[n] for n in keyframes)], dim=1)
    placed = ", ".join(f"latent frame {index} at {held}" for index, held in zip(indices, strengths, strict=True))
    placed += f"; {latents.shape[1] - video_tokens} keyframe tokens after the video's {video_tokens}"
    noise = randn_tensor(latents.shape, generator=generator, dtype=torch.float32)
    scaled_mask = (1.0 - mask) * noise_scale(request, given is not None)
    latents = noise * scaled_mask + latents * (1 - scaled_mask)
    return ConditionedVideo(latents, mask.squeeze(-1), clean, coords, video_tokens, placed)


def check_condition_size(conditions: list[torch.Tensor], height: int, width: int) -> None:
    """A pass at another size than stage 1 encoded the conditions for (one from upsampled latents) needs them
    encoded at its own size, as the pipeline's second call encodes them."""
    encoded = conditions[0].shape[-2:]
    if tuple(encoded) != (height, width):
        raise UserError(
            f"--{CONDITION.name}: stage 1 encoded the conditions for a {encoded[0]}x{encoded[1]} latent grid; this "
            f"pass runs {height}x{width} (latents from --start_latents at another size): run stage 1 with the same "
            "--condition flags at this pass's --height and --width and give stage 2 that folder"
        )
