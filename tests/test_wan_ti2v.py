"""Wan 2.2 TI2V-5B's layout (WanPipeline with expand_timesteps: a timestep per video token, the Wan 2.2 VAE)
through the three stages, in both of its tasks, against the pipelines run eagerly on the same saved tiny
components: text-to-video against WanPipeline, image-to-video against WanImageToVideoPipeline's
expand_timesteps branch built from the same components.

Tolerances, fp32: latents and frames 1e-4 relative (the staged run batches [cond, uncond] as one batch of 2);
the stage-1 image latents against what the pipeline computes, 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import stage1_text_encoder
from helpers import expect_user_error, relative_error, three_stages, write_image
from tpu_video import models
from utils import read_tensors

TOLERANCE = 1e-4
PRESET = "tiny-wan2.2-ti2v"
PROMPT, NEGATIVE = "a cat playing guitar", "blurry"
REQUEST = {"num_inference_steps": 4, "seed": 7}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return write_image(tmp_path_factory.mktemp("images") / "first.png", 64, 96)


@pytest.fixture(scope="module")
def pipelines():
    """The preset's WanPipeline, and WanImageToVideoPipeline's TI2V branch on the same components."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    text = WanPipeline.from_pretrained(models.materialize_preset(PRESET), dtype=torch.float32)
    assert text.config.expand_timesteps
    image = WanImageToVideoPipeline(**text.components, image_encoder=None, image_processor=None, expand_timesteps=True)
    return text, image


def run_pipeline(pipe, config, output_type, **extra):
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        guidance_scale=5.0,
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type=output_type,
        **{key: config[key] for key in ("height", "width", "num_frames", "num_inference_steps")},
        **extra,
    ).frames


def staged(out, stage1_flags=(), stage2_flags=()):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", PRESET, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", *stage1_flags]
    return three_stages(out, [*argv, *flags], stage2_flags)


def test_text_to_video_vs_wan_pipeline(tmp_path, pipelines):
    latents, frames, config = staged(tmp_path)
    assert config["stage1"]["task"] == "t2v" and [config["height"], config["width"]] == [64, 96]
    expected = run_pipeline(pipelines[0], config, "latent")
    assert latents.shape == expected.shape == (1, 16, 2, 4, 6)
    assert relative_error(latents, expected) <= TOLERANCE
    assert relative_error(frames, torch.from_numpy(run_pipeline(pipelines[0], config, "np")[0])) <= TOLERANCE


@pytest.mark.parametrize("mesh", [None, (2, 2, 2)], ids=["1-device", "splash-2x2x2"])
def test_image_to_video_vs_the_pipelines_expand_timesteps_branch(tmp_path, pipelines, image, mesh, monkeypatch):
    """The first latent frame is the image's and its tokens get timestep 0; on 2x2x2 with Splash the
    per-token modulation is split over sp like the tokens. Every block's inputs pass one optimization
    barrier (its modulation reads only the timestep; docs/planning.md has what that saves on a TPU), also
    inside the scan that runs the blocks (--scan_blocks auto)."""
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    barriers, barrier = [], TorchaxRuntime.barrier
    monkeypatch.setattr(TorchaxRuntime, "barrier", lambda self, *ts: barriers.append(len(ts)) or barrier(self, *ts))
    flags = [] if mesh is None else ["--attention", "splash", "--dp", mesh[0], "--sp", mesh[1], "--tp", mesh[2]]
    latents, frames, config = staged(tmp_path, ["--image", image], flags)
    blocks = len(pipelines[1].transformer.blocks)
    # per trace: the scan's body once, each block's hook outside it (the first block's starts the scan)
    assert barriers and len(barriers) % (blocks + 1) == 0, (len(barriers), blocks)
    assert config["stage1"]["task"] == "i2v"
    pipe = pipelines[1]
    seen = {}
    prepare = pipe.prepare_latents

    def record(*args, **kwargs):
        seen["outputs"] = prepare(*args, **kwargs)
        return seen["outputs"]

    pipe.prepare_latents = record
    try:
        expected = run_pipeline(pipe, config, "latent", image=Image.open(image).convert("RGB"))
    finally:
        pipe.prepare_latents = prepare
    assert relative_error(latents, expected) <= TOLERANCE
    stage1 = read_tensors(tmp_path, config["stage1"])["image_latents"]
    assert relative_error(stage1, seen["outputs"][1]) <= 1e-5
    assert torch.equal(latents[:, :, :1], stage1)  # the first frame is the image's, as in the pipeline
    if mesh is None:
        expected_frames = run_pipeline(pipe, config, "np", image=Image.open(image).convert("RGB"))[0]
        assert relative_error(frames, torch.from_numpy(expected_frames)) <= TOLERANCE


def test_last_image_is_refused(capsys, tmp_path, image):
    argv = ["--model", PRESET, "--prompt", "x", "--image", image, "--last_image", image, "--output_dir", tmp_path / "o"]
    expect_user_error(capsys, stage1_text_encoder, argv, "--last_image")
    assert not (tmp_path / "o").exists()
