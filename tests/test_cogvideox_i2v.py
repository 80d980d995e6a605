"""CogVideoX image-to-video (CogVideoXImageToVideoPipeline) through the three stages against the pipeline run
eagerly in PyTorch on the same saved tiny components, image and seed: the 1.5 layout (ofs embedding, pad
frame) and the 1.0 layout (learned positional embeddings), and a stage-2 seed override (the image latents
are sampled from the posterior with the stage-2 generator, before the noise, as in the pipeline).

Tolerances, fp32: the stage-1 posterior against the pipeline's own encode, 1e-5 relative; latents and frames
against the pipeline, 1e-4 relative, as for text-to-video.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import stage1_text_encoder
import stage2_transformer
from helpers import relative_error, run_stage, stop_stage2_after, three_stages, write_image
from tpu_video import models
from utils import read_config, read_tensors

TOLERANCE = 1e-4
PROMPT, NEGATIVE = "a red cat", "blurry"
REQUEST = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4, "seed": 7}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return write_image(tmp_path_factory.mktemp("image") / "first.png", 64, 96)


@pytest.fixture(scope="module")
def pipelines():
    from diffusers import CogVideoXImageToVideoPipeline

    return {
        preset: CogVideoXImageToVideoPipeline.from_pretrained(models.materialize_preset(preset), dtype=torch.float32)
        for preset in ("tiny-cogvideox-i2v", "tiny-cogvideox1.0-i2v")
    }


def run_pipeline(pipe, image, output_type, seed=REQUEST["seed"]):
    return pipe(
        image=Image.open(image).convert("RGB"),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=output_type,
        max_sequence_length=32,
        **{key: value for key, value in REQUEST.items() if key != "seed"},
    ).frames


def staged(out, preset, image, *stage2_flags):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", preset, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", "--image", image]
    return three_stages(out, [*argv, *flags], stage2_flags)


@pytest.mark.parametrize(
    "preset, stage2_flags, seed",
    [
        ("tiny-cogvideox-i2v", (), 7),
        ("tiny-cogvideox1.0-i2v", (), 7),
        ("tiny-cogvideox-i2v", ("--seed", "11"), 11),
    ],
    ids=["1.5", "1.0-learned-positions", "1.5-stage2-seed"],
)
def test_latents_and_frames_vs_pipeline(tmp_path, pipelines, image, preset, stage2_flags, seed):
    latents, frames, config = staged(tmp_path, preset, image, *stage2_flags)
    pipe = pipelines[preset]
    expected = run_pipeline(pipe, image, "latent", seed)  # (B, F, C, H, W), 1.5 keeps its pad frame
    pad = config["stage2"]["dropped_pad_latent_frames"]
    assert pad == (1 if preset == "tiny-cogvideox-i2v" else 0)
    assert relative_error(latents, expected[:, pad:].permute(0, 2, 1, 3, 4)) <= TOLERANCE
    assert relative_error(frames, torch.from_numpy(run_pipeline(pipe, image, "np", seed)[0])) <= TOLERANCE
    # the image matters, and so does the seed of the image sample: both move the result far off
    assert relative_error(latents, run_pipeline(pipe, image, "latent", seed + 1)[:, pad:].permute(0, 2, 1, 3, 4)) > 0.1


def test_stage1_posterior_equals_the_pipelines_encode(tmp_path, pipelines, image):
    pipe = pipelines["tiny-cogvideox-i2v"]
    seen = []
    encode = pipe.vae.encode

    def record(*args, **kwargs):
        output = encode(*args, **kwargs)
        seen.append(output.latent_dist.parameters)
        return output

    pipe.vae.encode = record
    try:
        run_pipeline(pipe, image, "latent")
    finally:
        pipe.vae.encode = encode
    out = tmp_path / "s1"
    argv = ["--model", "tiny-cogvideox-i2v", "--prompt", PROMPT, "--dtype", "fp32", "--image", image]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", out, *[f"--{k}={v}" for k, v in REQUEST.items()]])
    stored = read_tensors(out, read_config(out)["stage1"])["image_latent_parameters"]
    assert relative_error(stored, seen[0]) <= 1e-5


def test_a_stopped_run_resumes_bit_identically(tmp_path, image, monkeypatch):
    """The image sample is drawn again from the seed when the loop is rebuilt, then the checkpoint's latents
    and generator state take over: the resumed run equals the uninterrupted one bit for bit."""
    full, _, _ = staged(tmp_path / "full", "tiny-cogvideox-i2v", image)
    out = tmp_path / "stopped"
    argv = ["--model", "tiny-cogvideox-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(
        stage1_text_encoder, [*argv, "--image", image, "--output_dir", out, *[f"--{k}={v}" for k, v in REQUEST.items()]]
    )
    stop_stage2_after(monkeypatch, ["--input_dir", out], steps=2)
    run_stage(stage2_transformer, ["--input_dir", out, "--resume"])
    assert torch.equal(read_tensors(out, read_config(out)["stage2"])["latents"], full)


def test_a_second_pass_with_the_dpm_sampler_equals_the_pipeline_called_twice(tmp_path, pipelines, image):
    """The 1.0 layout with CogVideoX-5b-I2V's DPM sampler (saved as a model folder): a second pass from the
    first's latents, where the pipeline still samples the image's latents from the generator but draws no noise
    (tests/test_passes.py has text-to-video)."""
    from diffusers import CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline

    shared, model = pipelines["tiny-cogvideox1.0-i2v"], tmp_path / "model"
    scheduler = CogVideoXDPMScheduler.from_config(shared.scheduler.config)
    pipe = CogVideoXImageToVideoPipeline(**{**shared.components, "scheduler": scheduler})  # the fixture's stays
    pipe.save_pretrained(model)
    first, second = tmp_path / "first", tmp_path / "second"
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", model, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", "--image", image]
    run_stage(stage1_text_encoder, [*argv, *flags, "--output_dir", first])
    run_stage(stage2_transformer, ["--input_dir", first])
    later = ["--num_inference_steps", 3, "--guidance_scale", 3.0, "--seed", 8]  # the pass draws from its own seed
    run_stage(stage2_transformer, ["--input_dir", first, "--start_latents", first, "--output_dir", second, *later])

    picture = Image.open(image).convert("RGB")
    call = {**{key: value for key, value in REQUEST.items() if key != "seed"}, "max_sequence_length": 32}
    generator = torch.Generator("cpu")
    run = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "image": picture, "output_type": "latent"}
    first_latents = pipe(**run, **call, generator=generator.manual_seed(7)).frames
    call.update(num_inference_steps=3, guidance_scale=3.0, latents=first_latents)
    second_latents = pipe(**run, **call, generator=generator.manual_seed(8)).frames
    assert relative_error(second_latents, first_latents) > 1e-2  # the second pass did change them
    staged = read_tensors(second, read_config(second, needs="stage2")["stage2"])["latents"]
    assert relative_error(staged, second_latents.permute(0, 2, 1, 3, 4)) <= TOLERANCE
