"""Wan image-to-video (WanImageToVideoPipeline) through the three stages against the pipeline run eagerly in
PyTorch on the same saved tiny components, image and seed.

Tolerances, fp32: the stage-1 conditioning against what the pipeline hands its transformer, 1e-5 relative;
latents and frames against the pipeline, 1e-4 relative (the staged run batches [cond, uncond] as one batch
of 2 where the pipeline makes two batch-1 calls), as for text-to-video.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import stage1_text_encoder
import stage2_transformer
from helpers import expect_user_error, relative_error, run_stage, stop_stage2_after, three_stages
from tpu_video import models
from tpu_video.models import wan
from utils import CONFIG_FILE, read_config, read_tensors

TOLERANCE = 1e-4
CONDITIONING_TOLERANCE = 1e-5
PROMPT, NEGATIVE = "a cat playing guitar", "blurry"
REQUEST = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 6, "seed": 7}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A first frame (40x60, the request's 2:3) and a different last frame (a 1:1 square, resized)."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(folder / "first.png")
    Image.fromarray(rng.integers(0, 256, (50, 50, 3), dtype=np.uint8)).save(folder / "last.jpg")
    return folder / "first.png", folder / "last.jpg"


@pytest.fixture(scope="module")
def pipelines():
    from diffusers import WanImageToVideoPipeline

    return {
        preset: WanImageToVideoPipeline.from_pretrained(models.materialize_preset(preset), dtype=torch.float32)
        for preset in ("tiny-wan2.1-i2v", "tiny-wan2.2-i2v")
    }


def run_pipeline(pipe, image, last_image=None, output_type="latent", guidance_scale=5.0):
    return pipe(
        image=Image.open(image).convert("RGB"),
        last_image=None if last_image is None else Image.open(last_image).convert("RGB"),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        guidance_scale=guidance_scale,
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type=output_type,
        **{key: value for key, value in REQUEST.items() if key != "seed"},
    ).frames


def staged(out, preset, image, last_image=None, stage2_flags=(), guidance_scale=5.0):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", preset, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", "--image", image]
    argv += [] if last_image is None else ["--last_image", last_image]
    return three_stages(out, [*argv, "--guidance_scale", guidance_scale, *flags], stage2_flags)


def transformer_inputs(pipe, image, last_image=None):
    """What the pipeline hands its (first) transformer at the first step: hidden states and image tokens."""
    seen = {}
    forward = pipe.transformer.forward

    def record(*args, **kwargs):
        seen.setdefault("inputs", kwargs)
        return forward(*args, **kwargs)

    pipe.transformer.forward = record
    try:
        run_pipeline(pipe, image, last_image)
    finally:
        pipe.transformer.forward = forward
    return seen["inputs"]


def test_stage1_conditioning_equals_what_the_pipeline_computes(tmp_path, pipelines, images):
    out = tmp_path / "s1"
    argv = ["--model", "tiny-wan2.1-i2v", "--prompt", PROMPT, "--dtype", "fp32", "--image", images[0]]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", out, *[f"--{k}={v}" for k, v in REQUEST.items()]])
    config = read_config(out, needs="stage1")
    tensors = read_tensors(out, config["stage1"])
    inputs = transformer_inputs(pipelines["tiny-wan2.1-i2v"], images[0])
    assert relative_error(tensors["image_embeds"], inputs["encoder_hidden_states_image"]) <= CONDITIONING_TOLERANCE
    assert relative_error(tensors["condition"], inputs["hidden_states"][:, 16:]) <= CONDITIONING_TOLERANCE
    assert tensors["condition"].shape == (1, 4 + 16, 2, 4, 6)
    stage1 = config["stage1"]
    assert stage1["task"] == "i2v" and stage1["inputs"]["image"]["file"] == "first.png"
    assert stage1["inputs"]["image"]["kind"] == "image"
    assert stage1["inputs"]["image"]["size"] == [40, 60] and stage1["inputs"]["image"]["processed_size"] == [32, 48]


@pytest.mark.parametrize(
    "stage2_flags",
    [(), ("--dp", "2", "--sp", "2", "--tp", "2", "--attention", "splash")],
    ids=["default-mesh", "2x2x2-splash"],
)
def test_wan21_i2v_latents_and_frames_vs_pipeline(tmp_path, pipelines, images, stage2_flags):
    latents, frames, config = staged(tmp_path, "tiny-wan2.1-i2v", images[0], stage2_flags=stage2_flags)
    pipe = pipelines["tiny-wan2.1-i2v"]
    expected = run_pipeline(pipe, images[0])
    assert latents.shape == expected.shape == (1, 16, 2, 4, 6)
    assert relative_error(latents, expected) <= TOLERANCE
    assert relative_error(frames, torch.from_numpy(run_pipeline(pipe, images[0], output_type="np")[0])) <= TOLERANCE
    # the image matters: another first frame moves the result far beyond the tolerance
    assert relative_error(latents, run_pipeline(pipe, images[1])) > 100 * TOLERANCE


def test_wan22_i2v_with_a_last_frame_across_the_expert_switch(tmp_path, pipelines, images):
    latents, frames, config = staged(tmp_path, "tiny-wan2.2-i2v", *images)
    stage2 = config["stage2"]
    assert stage2["experts"] == ["transformer", "transformer_2"] and stage2["expert_2_from_step"] is not None
    pipe = pipelines["tiny-wan2.2-i2v"]
    assert relative_error(latents, run_pipeline(pipe, *images)) <= TOLERANCE
    assert relative_error(frames, torch.from_numpy(run_pipeline(pipe, *images, output_type="np")[0])) <= TOLERANCE
    assert relative_error(latents, run_pipeline(pipe, images[0])) > 100 * TOLERANCE  # the last frame matters
    assert "image_embeds" not in read_tensors(tmp_path, config["stage1"])  # no image encoder in Wan 2.2


def test_a_stopped_i2v_run_resumes_bit_identically(tmp_path, images, monkeypatch):
    """Stopped after step 2 of 6 (as SIGTERM stops it: a checkpoint, then Stopped), resumed with --resume:
    the conditioning comes back from the stage-1 file and the result equals the uninterrupted run's bits."""
    from utils import CHECKPOINT_FILE

    full, _, _ = staged(tmp_path / "full", "tiny-wan2.2-i2v", *images)
    out = tmp_path / "stopped"
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", "tiny-wan2.2-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--image", images[0], "--last_image", images[1], "--guidance_scale", 5.0, "--output_dir", out]
    run_stage(stage1_text_encoder, [*argv, *flags])
    stop_stage2_after(monkeypatch, ["--input_dir", out], steps=2)
    assert (out / CHECKPOINT_FILE).exists()
    run_stage(stage2_transformer, ["--input_dir", out, "--resume"])
    assert torch.equal(read_tensors(out, read_config(out)["stage2"])["latents"], full)


@pytest.mark.parametrize(
    "model, flags, message",
    [
        ("tiny-wan2.1-i2v", [], "is an image-to-video model: give the first frame with --image PATH"),
        ("tiny-wan2.1", ["--image", "FIRST"], "takes no image (a text-to-video model)"),
        ("tiny-cogvideox", ["--image", "FIRST"], "takes no image (a text-to-video model)"),
        ("tiny-wan2.1-i2v", ["--image", "FIRST", "--last_image", "FIRST"], "takes no --last_image"),
        ("tiny-wan2.1-i2v", ["--image", "EMPTY"], "is empty (0 bytes)"),
        ("tiny-wan2.1-i2v", ["--image", "TEXT"], "is not a readable image"),
        ("tiny-wan2.1-i2v", ["--image", "TRUNCATED"], "is not a readable image"),
        ("tiny-wan2.1-i2v", ["--image", "GIF"], "is an animated GIF (2 frames); give a still image"),
        ("tiny-wan2.1-i2v", ["--image", "MISSING"], "no such file"),
    ],
)
def test_image_errors_before_loading(capsys, tmp_path, images, model, flags, message, no_weights_loaded):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "truncated.png").write_bytes(images[0].read_bytes()[:200])
    Image.new("RGB", (8, 8)).save(
        tmp_path / "image.gif", save_all=True, append_images=[Image.new("RGB", (8, 8), "red")]
    )
    paths = {"FIRST": images[0], "EMPTY": tmp_path / "empty.png", "TEXT": tmp_path / "text.png"}
    paths |= {"TRUNCATED": tmp_path / "truncated.png", "GIF": tmp_path / "image.gif", "MISSING": tmp_path / "no.png"}
    out = tmp_path / "out"
    argv = ["--model", model, "--prompt", "x", "--output_dir", out, *[str(paths.get(flag, flag)) for flag in flags]]
    expect_user_error(capsys, stage1_text_encoder, argv, message)
    assert not out.exists()


def test_stage2_refuses_t2v_files_for_an_i2v_model(capsys, tmp_path):
    out = tmp_path / "t2v"
    run_stage(stage1_text_encoder, ["--model", "tiny-wan2.1", "--prompt", "x", "--output_dir", out])
    before = (out / CONFIG_FILE).read_bytes()
    message = "hold no image conditioning, but --model 'tiny-wan2.1-i2v' is an image-to-video model"
    expect_user_error(capsys, stage2_transformer, ["--input_dir", out, "--model", "tiny-wan2.1-i2v"], message)
    assert (out / CONFIG_FILE).read_bytes() == before


def test_tiny_i2v_transformer_matches_the_published_layout():
    """The tiny Wan 2.1 I2V transformer has the published one's extra modules (every rule of the table used)."""
    import sharding

    transformer = wan.presets.tiny_i2v_pipeline("2.1").transformer
    names = [name for name, _ in transformer.named_parameters()]
    specs = wan.transformer_rules().assign(names)
    assert specs["blocks.0.attn2.add_k_proj.weight"] == sharding.COLUMN
    assert specs["blocks.0.attn2.norm_added_k.weight"] == sharding.COLUMN_BIAS
    assert transformer.config.in_channels == wan.presets.WAN_I2V_CHANNELS == 36
