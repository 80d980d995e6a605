"""HunyuanVideo-1.5 image-to-video (HunyuanVideo15ImageToVideoPipeline) through the three stages against the
pipeline run eagerly in PyTorch on the same saved tiny components, image and seed. The video's size comes from
the image (the pipeline's size bucket and centre crop), so stage 1 takes no --height/--width.

Tolerances, fp32: latents and frames 1e-4 relative, as for text-to-video; the stage-1 image tensors against
what the pipeline hands its transformer, 1e-5.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import helpers
import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, relative_error, run_stage, stop_stage2_after
from utils import read_config, read_tensors

TOLERANCE = 1e-4
PRESET = "tiny-hunyuanvideo15-i2v"
PROMPT, NEGATIVE = "A cat walks on the grass", "blurry"
REQUEST = {"num_frames": 5, "num_inference_steps": 3, "seed": 7}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A wide and a tall image: different size buckets (56x40 and 40x56 at the preset's target size 48)."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(folder / "wide.png")
    Image.fromarray(rng.integers(0, 256, (70, 45, 3), dtype=np.uint8)).save(folder / "tall.jpg")
    return folder / "wide.png", folder / "tall.jpg"


@pytest.fixture(scope="module")
def pipeline():
    return helpers.pipeline(PRESET)


def run_pipeline(pipe, image, output_type):
    return pipe(
        image=Image.open(image).convert("RGB"),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        num_frames=REQUEST["num_frames"],
        num_inference_steps=REQUEST["num_inference_steps"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type=output_type,
    ).frames


@pytest.mark.parametrize("which, size", [(0, [40, 56]), (1, [56, 40])], ids=["wide", "tall"])
def test_latents_and_frames_vs_pipeline(capsys, tmp_path, pipeline, images, which, size):
    image = images[which]
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", PRESET, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", "--image", image]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path, *flags])
    run_stage(stage2_transformer, ["--input_dir", tmp_path])
    run_stage(stage3_vae_decoder, ["--input_dir", tmp_path, "--save_frames"])
    config = read_config(tmp_path, needs="stage3")
    assert [config["height"], config["width"]] == config["stage1"]["inputs"]["image"]["processed_size"] == size
    latents = read_tensors(tmp_path, config["stage2"])["latents"]
    expected = run_pipeline(pipeline, image, "latent")
    assert latents.shape == expected.shape
    assert relative_error(latents, expected) <= TOLERANCE
    frames = read_tensors(tmp_path, config["stage3"]["frames_file"])["frames_float"]
    assert relative_error(frames, torch.from_numpy(run_pipeline(pipeline, image, "np")[0])) <= TOLERANCE
    capsys.readouterr()
    message = "--num_frames: stage 1 encoded the image for"
    expect_user_error(capsys, stage2_transformer, ["--input_dir", tmp_path, "--num_frames", 9], message)


def test_stage1_image_tensors_equal_what_the_pipeline_hands_its_transformer(tmp_path, pipeline, images):
    seen = {}
    forward = pipeline.transformer.forward

    def record(*args, **kwargs):
        seen.setdefault("inputs", kwargs)
        return forward(*args, **kwargs)

    pipeline.transformer.forward = record
    try:
        run_pipeline(pipeline, images[0], "latent")
    finally:
        pipeline.transformer.forward = forward
    argv = ["--model", PRESET, "--prompt", PROMPT, "--dtype", "fp32", "--image", images[0], "--output_dir", tmp_path]
    run_stage(stage1_text_encoder, argv)
    tensors = read_tensors(tmp_path, read_config(tmp_path)["stage1"])
    inputs = seen["inputs"]
    assert relative_error(tensors["image_embeds"], inputs["image_embeds"]) <= 1e-5
    assert relative_error(tensors["image_latents"], inputs["hidden_states"][:, 4:8, :1]) <= 1e-5


def test_height_and_width_are_refused(capsys, tmp_path, images, no_weights_loaded):
    argv = ["--model", PRESET, "--prompt", "x", "--image", images[0], "--output_dir", tmp_path / "out", "--width", 48]
    expect_user_error(capsys, stage1_text_encoder, argv, "takes the video's size from the image (40x56 for this one")
    assert not (tmp_path / "out").exists()


def test_step_distilled_checkpoint_vs_pipeline_and_resumed_bit_identically(monkeypatch, tmp_path, images):
    """The 480p_i2v_step_distilled layout (meanflow: each step also embeds the next step's timestep; guidance 1,
    shift 7 from its folder) against its pipeline; and the same run stopped by SIGTERM after step 2 and resumed
    with --resume, bit-identical to the uninterrupted one."""

    preset = "tiny-hunyuanvideo15-i2v-step-distilled"
    argv = ["--model", preset, "--prompt", PROMPT, "--dtype", "fp32", "--image", images[0], "--seed", 7]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path / "a"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    run_stage(stage2_transformer, ["--input_dir", tmp_path / "a"])
    config = read_config(tmp_path / "a", needs="stage2")
    assert config["guidance_scale"] == 1.0 and config["flow_shift"] == 7.0 and config["num_inference_steps"] == 4
    assert not config["stage2"]["classifier_free_guidance"]
    latents = read_tensors(tmp_path / "a", config["stage2"])["latents"]
    pipe = helpers.pipeline(preset)
    assert pipe.transformer.config.use_meanflow
    expected = pipe(
        image=Image.open(images[0]).convert("RGB"),
        prompt=PROMPT,
        num_frames=config["num_frames"],
        num_inference_steps=4,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames
    assert relative_error(latents, expected) <= TOLERANCE

    stop_stage2_after(monkeypatch, ["--input_dir", tmp_path / "b"], steps=2)
    run_stage(stage2_transformer, ["--input_dir", tmp_path / "b", "--resume"])
    resumed = read_tensors(tmp_path / "b", read_config(tmp_path / "b", needs="stage2")["stage2"])["latents"]
    assert torch.equal(resumed, latents)
