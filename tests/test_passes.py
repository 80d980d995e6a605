"""Two denoises of one video (tpu_video/engine/passes.py): a second pass started from the first's latents (where
it would draw its noise) with its own steps and guidance, against WanPipeline called twice the same way (the
second call given the first's latents). Each pass is its own stage folder: recorded, resumable, rerunnable alone.

Tolerance: the staged run against the pipeline, 1e-4 relative in fp32, as in tests/test_wan.py (the staged
run batches [cond, uncond] where the pipeline makes two calls); the resumed pass equals the uninterrupted one
exactly (the same computation repeated).
"""

from __future__ import annotations

import pytest
import torch

import helpers
import stage1_text_encoder
import stage2_transformer
from helpers import expect_user_error, relative_error, run_stage, stop_stage2_after
from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.engine.decode import decode
from tpu_video.runtime.interface import Timer, TorchRuntime
from utils import CHECKPOINT_FILE, CONFIG_FILE, Request, read_config, read_tensors

TOLERANCE = 1e-4
PROMPT, NEGATIVE = "a cat playing guitar", "blurry"
SIZE = {"height": 32, "width": 48, "num_frames": 5}
FIRST = {"num_inference_steps": 4, "seed": 7, "guidance_scale": 5.0}
SECOND = {"num_inference_steps": 3, "seed": 7, "guidance_scale": 3.0}  # Wan's sampler draws nothing from the seed


def flags(values: dict) -> list[str]:
    return [f"--{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def passes(tmp_path_factory):
    """Stage 1 and the first pass in `first`, the second pass from its latents in `second`."""
    root = tmp_path_factory.mktemp("passes")
    first, second = root / "first", root / "second"
    argv = ["--model", "tiny-wan2.1", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", first, *flags({**SIZE, **FIRST})])
    run_stage(stage2_transformer, ["--input_dir", first])
    run_stage(
        stage2_transformer, ["--input_dir", first, "--start_latents", first, "--output_dir", second, *flags(SECOND)]
    )
    return first, second


def pipeline_call(pipe, request: dict, **extra):
    generator = torch.Generator("cpu").manual_seed(request["seed"])
    kwargs = {key: value for key, value in request.items() if key != "seed"}
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=generator, **SIZE, **kwargs, **extra).frames


def test_a_second_pass_equals_the_pipeline_called_twice(passes):
    from diffusers import WanPipeline

    first, second = passes
    pipe = WanPipeline.from_pretrained(models.materialize_preset("tiny-wan2.1"), dtype=torch.float32)
    first_latents = pipeline_call(pipe, FIRST, output_type="latent")
    second_latents = pipeline_call(pipe, SECOND, output_type="latent", latents=first_latents)
    assert relative_error(second_latents, first_latents) > 1e-2  # the second pass did change them

    config = read_config(first, needs="stage2")
    assert relative_error(read_tensors(first, config["stage2"])["latents"], first_latents) <= TOLERANCE
    config = read_config(second, needs="stage2")
    latents = read_tensors(second, config["stage2"])["latents"]
    assert relative_error(latents, second_latents) <= TOLERANCE
    start = config["stage2"]["start_latents"]
    assert start["sha256"] == read_config(first)["stage2"]["sha256"] and start["seed"] == 7 and start["steps"] == 4
    assert config["stage2"]["overrides"] == {"num_inference_steps": [4, 3], "guidance_scale": [5.0, 3.0]}

    source, family = models.resolve_model("tiny-wan2.1")
    normalization = config["stage2"]["latents_normalization"]
    frames = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    expected = torch.from_numpy(pipeline_call(pipe, SECOND, output_type="np", latents=first_latents)[0])
    assert frames.shape == expected.shape == (5, 32, 48, 3)
    assert relative_error(frames, expected) <= TOLERANCE


def test_a_pass_resumes_and_a_changed_start_is_not_resumed(passes, monkeypatch, tmp_path, capsys):
    first, second = passes
    whole = read_tensors(second, read_config(second)["stage2"])["latents"]
    again = tmp_path / "again"
    argv = ["--input_dir", first, "--start_latents", first, "--output_dir", again, *flags(SECOND)]
    stop_stage2_after(monkeypatch, argv, steps=1)
    run_stage(stage2_transformer, [*argv, "--resume"])
    assert torch.equal(read_tensors(again, read_config(again)["stage2"])["latents"], whole)

    stop_stage2_after(monkeypatch, argv, steps=1)
    other = tmp_path / "other"  # another first pass: its latents are not the ones the checkpoint started from
    run_stage(stage2_transformer, ["--input_dir", first, "--output_dir", other, "--seed", 8])
    moved = ["--input_dir", first, "--start_latents", other, "--output_dir", again, *flags(SECOND), "--resume"]
    expect_user_error(capsys, stage2_transformer, moved, "(start_latents differs)")
    assert (again / CHECKPOINT_FILE).is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "is the folder this pass writes"),
        (["--output_dir", "ELSEWHERE", "--height", "64"], "holds latents for height 32; this run asks for height 64"),
        (["--output_dir", "ELSEWHERE", "--model", "tiny-wan2.2"], None),
        (["--input_dir", "FIRST", "ELSEWHERE"], "--start_latents names one folder's latents"),
    ],
    ids=["writes-over-its-start", "another-size", "another-model", "several-folders"],
)
def test_bad_passes_are_refused_before_loading(passes, capsys, tmp_path, extra, message):
    first, _ = passes
    extra = [str(tmp_path / "else") if item == "ELSEWHERE" else item for item in extra]
    extra = [str(first) if item == "FIRST" else item for item in extra]
    argv = ["--input_dir", first, "--start_latents", first, *extra]
    if message is None:  # another model of the family may continue a pass: only the family and size must agree
        run_stage(stage2_transformer, [*argv, "--num_inference_steps", 1])
        return
    expect_user_error(capsys, stage2_transformer, argv, message)


def test_a_hunyuanvideo15_second_pass_equals_the_pipeline_called_twice(tmp_path):
    """HunyuanVideo-1.5 (its guider; 3 steps, then 2 with another guidance scale) as the Wan passes above."""
    first, second = tmp_path / "first", tmp_path / "second"
    passes = ({**FIRST, "num_inference_steps": 3}, {**SECOND, "num_inference_steps": 2})
    argv = ["--model", "tiny-hunyuanvideo15", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", first, *flags({**SIZE, **passes[0]})])
    run_stage(stage2_transformer, ["--input_dir", first])
    run_stage(
        stage2_transformer, ["--input_dir", first, "--start_latents", first, "--output_dir", second, *flags(passes[1])]
    )

    pipe, latents = helpers.pipeline("tiny-hunyuanvideo15"), None
    for request in passes:  # the guider holds the scale; the call takes the rest
        pipe.guider.guidance_scale = request["guidance_scale"]
        call = {"seed": request["seed"], "num_inference_steps": request["num_inference_steps"]}
        before, latents = latents, pipeline_call(pipe, call, output_type="latent", latents=latents)
    assert relative_error(latents, before) > 1e-2  # the second pass did change them
    staged = read_tensors(second, read_config(second, needs="stage2")["stage2"])["latents"]
    assert relative_error(staged, latents) <= TOLERANCE


def test_a_cogvideox_second_pass_with_the_dpm_sampler_equals_the_pipeline_called_twice(tmp_path):
    """CogVideoX (the 1.0 layout with CogVideoX-5b's DPM sampler, which draws from the generator at every step,
    saved as a model folder): the pass from given latents goes on from the generator's state before the noise
    it does not draw, as the pipeline's latents= path does."""
    from diffusers import CogVideoXDPMScheduler

    first, second, model = tmp_path / "first", tmp_path / "second", tmp_path / "model"
    pipe = helpers.pipeline("tiny-cogvideox1.0")
    pipe.scheduler = CogVideoXDPMScheduler.from_config(pipe.scheduler.config)
    pipe.save_pretrained(model)
    size = {"height": 64, "width": 96, "num_frames": 9}
    later = {**SECOND, "seed": 8}  # the DPM sampler draws from the pass's own seed while stepping
    argv = ["--model", model, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", first, *flags({**size, **FIRST})])
    run_stage(stage2_transformer, ["--input_dir", first])
    run_stage(
        stage2_transformer, ["--input_dir", first, "--start_latents", first, "--output_dir", second, *flags(later)]
    )

    call = {**size, "max_sequence_length": pipe.transformer.config.max_text_seq_length, "output_type": "latent"}
    latents = None
    for request in (FIRST, later):
        generator = torch.Generator("cpu").manual_seed(request["seed"])
        steps, scale = request["num_inference_steps"], request["guidance_scale"]
        run = {**call, "num_inference_steps": steps, "guidance_scale": scale, "latents": latents}
        before, latents = latents, pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=generator, **run).frames
    assert relative_error(latents, before) > 1e-2  # the second pass did change them
    staged = read_tensors(second, read_config(second, needs="stage2")["stage2"])["latents"]
    assert relative_error(staged, latents.permute(0, 2, 1, 3, 4)) <= TOLERANCE

    # Refused before loading: CogVideoX 1.5 (the pad frames its latents= path takes back).
    family, request = models.FAMILIES["cogvideox"], Request.from_config(read_config(first), first / CONFIG_FILE)
    with pytest.raises(UserError, match="CogVideoX 1.5 pads its latent frames to whole temporal patches"):
        family.start_from(models.resolve_model("tiny-cogvideox")[0], request, {}, {})


def test_families_without_an_upsampler_say_so():
    for name in ("cogvideox", "hunyuanvideo15", "wan"):
        with pytest.raises(UserError, match=f"--upsample: {name} has no latent upsampler"):
            models.FAMILIES[name].upsample(None, None, {}, None, None)
