"""More than one denoise per video: a pass that starts from an earlier pass's latents where it would draw its
initial noise, as a pipeline called with `latents=` (its own steps, guidance, model or adapter; the building
block of LTX-2's refine after its latent upsampler, which adds its own sigmas).

Each pass is a stage folder, so each is recorded, resumable and rerunnable alone: stage 2's
`--start_latents FOLDER` reads that folder's stage-2 latents (checked: same family, the size and frame count
this run asks for, the recorded sha256), records which file it started from in its section and its checkpoint
fingerprint, and the family turns them into its loop's first latents as its pipeline does when called with
`latents=` (`Family.start_from`). A folder the step between passes wrote (stage 2's `--upsample`) holds latents
at a new size, which the pass from it takes unless `--height`/`--width` are given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpu_video.cli import UserError
from utils import CONFIG_FILE, Request, check_stage2_fresh, read_config, read_tensors

from .batch_folders import BATCH_FILE
from .inputs import GEOMETRY


@dataclass(frozen=True)
class StartLatents:
    """An earlier pass's stage-2 tensors and what this pass records about them (no host paths)."""

    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]


def read_start(folder: Path, request, output_dir: Path, stage1_only: tuple[str, ...] = ()) -> StartLatents:
    """The stage-2 latents in `folder`, checked against this run's request (and fresh for their own stage-1
    file and request: `stage1_only` as Request.fingerprint takes it), before any weights load."""
    if folder.resolve() == output_dir.resolve():
        raise UserError(
            f"--start_latents {folder} is the folder this pass writes: it would replace the latents it starts "
            "from; give the pass its own --output_dir"
        )
    if (folder / BATCH_FILE).is_file() and not (folder / CONFIG_FILE).is_file():
        raise UserError(f"--start_latents {folder} is a batch folder; name one video's folder in it")
    config = read_config(folder, needs="stage2")
    if config.get("model_family") != request.model_family:
        raise UserError(
            f"--start_latents {folder} holds {config.get('model_family')} latents; this run is {request.model_family}"
        )
    differ = [key for key in GEOMETRY if config.get(key) != getattr(request, key)]
    if differ:
        theirs = ", ".join(f"{key} {config.get(key)}" for key in differ)
        ours = ", ".join(f"{key} {getattr(request, key)}" for key in differ)
        raise UserError(f"--start_latents {folder} holds latents for {theirs}; this run asks for {ours}")
    check_stage2_fresh(folder, config, Request.from_config(config, folder / CONFIG_FILE), stage1_only)
    stage2 = config["stage2"]
    tensors = read_tensors(folder, stage2)
    made = stage2.get("request", {})  # what that stage 2 ran
    record = {
        "folder": folder.name,
        "file": stage2["file"],
        "sha256": stage2["sha256"],
        "model_id": made.get("model_id"),
    }
    if "upsampled" in stage2:  # the step between passes: the latents it upsampled were made by the pass before
        record["upsampled"] = {"from_sha256": stage2["upsampled"]["sha256"], "scale": stage2["upsampled"]["scale"]}
    return StartLatents(tensors, {**record, "seed": made.get("seed"), "steps": made.get("num_inference_steps")})


def upsampled_size(folder: Path) -> dict[str, int]:
    """The height and width of a folder written by the step between passes (stage 2's `--upsample`), which a
    pass from it runs at unless told otherwise; {} for any other folder (or one that cannot be read: read_start
    then says why)."""
    try:
        config = read_config(folder, needs="stage2")
    except UserError:
        return {}
    if "upsampled" not in config["stage2"]:
        return {}
    return {"height": config["height"], "width": config["width"]}


def started(loop, start: torch.Tensor | None):
    """`loop` (engine.denoise.DenoiseLoop) from an earlier pass's latents (the family's `start_from`), or as
    built, from noise, where `start` is None. The pipeline's `latents=` path draws no initial noise, so the
    generator goes back to where it was before the loop drew it (`noise_state`, where the loop keeps one)."""
    if start is None:
        return loop
    if start.shape != loop.latents.shape:
        raise UserError(
            f"--start_latents: latents of shape {tuple(start.shape)}; this loop starts from {tuple(loop.latents.shape)}"
        )
    if loop.noise_state is not None:
        loop.generator.set_state(loop.noise_state)
    return dataclasses.replace(loop, latents=start.to(loop.latents.dtype))
