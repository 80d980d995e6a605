"""The staged HunyuanVideo-1.5 run against HunyuanVideo15Pipeline run eagerly in PyTorch, tiny components.

Tolerance: 1e-4 relative (Frobenius) in fp32, as for CogVideoX. The staged run batches [cond, uncond] as
one batch of 2 where the pipeline's guider runs them one after the other; the guider's own formula
combines them in both.
"""

from __future__ import annotations

import pytest
import torch

import helpers
import stage1_text_encoder
import stage2_transformer
from helpers import relative_error, run_stage
from tpu_video import models
from tpu_video.engine.decode import decode
from tpu_video.runtime.interface import Timer, TorchRuntime
from utils import read_config, read_tensors

TOLERANCE = 1e-4
PRESET = "tiny-hunyuanvideo15"
NEGATIVE = "blurry"
REQUEST = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 3, "seed": 7}


@pytest.fixture(scope="module")
def reference():
    return helpers.pipeline(PRESET)


def run_pipeline(pipe, prompt: str, guidance_scale: float, output_type: str):
    pipe.guider.guidance_scale = guidance_scale
    return pipe(
        prompt=prompt,
        negative_prompt=NEGATIVE,
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_frames=REQUEST["num_frames"],
        num_inference_steps=REQUEST["num_inference_steps"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type=output_type,
    ).frames


def staged_latents(out, prompt: str, guidance_scale: float, *stage2_flags):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", PRESET, "--prompt", prompt, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--guidance_scale", guidance_scale, "--output_dir", out, *flags])
    run_stage(stage2_transformer, ["--input_dir", out, *stage2_flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config


def test_the_presets_shorter_padding_changes_only_the_time(reference):
    """The tiny preset pads the text and image tokens to less than the pipeline does (declarations.TINY_LENGTHS);
    the padding is masked, so the pipeline itself gives the same latents either way."""
    from diffusers import HunyuanVideo15Pipeline

    stock = HunyuanVideo15Pipeline(**reference.components)
    assert (stock.tokenizer_max_length, stock.tokenizer_2_max_length, stock.vision_num_semantic_tokens) == (
        1000,
        256,
        729,
    )
    assert reference.tokenizer_max_length == 512
    prompt = ('A shop sign that reads "OPEN" at night, ' * 3)[:114]  # the longest that 512 tokens hold
    padded, short = (run_pipeline(pipe, prompt, 6.0, "latent") for pipe in (stock, reference))
    assert relative_error(short, padded) <= 1e-5


@pytest.mark.parametrize("guidance_scale", [6.0, 1.0], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize(
    "prompt", ['A shop sign that reads "OPEN" at night', "A cat walks on the grass"], ids=["quoted", "plain"]
)
def test_staged_latents_and_frames_vs_pipeline(tmp_path, reference, prompt, guidance_scale):
    staged, config = staged_latents(tmp_path, prompt, guidance_scale)
    assert config["flow_shift"] == 5.0 and config["stage2"]["classifier_free_guidance"] == (guidance_scale != 1.0)
    expected = run_pipeline(reference, prompt, guidance_scale, "latent")
    assert staged.shape == expected.shape == (1, 4, 2, 4, 6)
    assert relative_error(staged, expected) <= TOLERANCE

    source, family = models.resolve_model(PRESET)
    frames = decode(
        family, source, staged, family.latents_normalization(source), torch.float32, TorchRuntime("cpu"), Timer()
    )
    expected_frames = torch.from_numpy(run_pipeline(reference, prompt, guidance_scale, "np")[0])
    assert frames.shape == expected_frames.shape == (5, 32, 48, 3)
    assert relative_error(frames, expected_frames) <= TOLERANCE


def test_quoted_text_reaches_byt5_and_plain_text_gives_zeros(tmp_path):
    _, config = staged_latents(tmp_path / "q", 'A sign that reads "OPEN"', 6.0, "--num_inference_steps", 1)
    quoted = read_tensors(tmp_path / "q", config["stage1"])
    assert quoted["prompt_embeds_mask_2"].sum() > 0 and quoted["prompt_embeds_2"].abs().sum() > 0
    _, config = staged_latents(tmp_path / "p", "A plain prompt", 6.0, "--num_inference_steps", 1)
    plain = read_tensors(tmp_path / "p", config["stage1"])
    assert plain["prompt_embeds_mask_2"].sum() == 0 and plain["prompt_embeds_2"].abs().sum() == 0


def test_flow_shift_override_is_used_and_recorded(tmp_path, reference):
    staged, config = staged_latents(tmp_path, "A cat", 6.0, "--flow_shift", 2.0)
    assert config["stage2"]["flow_shift"] == 2.0
    assert config["stage2"]["overrides"]["flow_shift"] == [5.0, 2.0]
    # set_shift, not register_to_config: FlowMatchEuler keeps the shift it was built with (models.common.flow_scheduler)
    reference.scheduler.set_shift(2.0)
    try:
        expected = run_pipeline(reference, "A cat", 6.0, "latent")
    finally:
        reference.scheduler.set_shift(5.0)
    assert relative_error(staged, expected) <= TOLERANCE
    assert relative_error(staged, run_pipeline(reference, "A cat", 6.0, "latent")) > 10 * TOLERANCE  # it is used


@pytest.mark.slow
@pytest.mark.parametrize("mesh, sp_mode", [((2, 1, 4), "auto"), ((1, 4, 2), "ring")], ids=["2x1x4", "1x4x2-ring"])
def test_splash_on_a_mesh_vs_pipeline(tmp_path, reference, mesh, sp_mode):
    """Splash (interpret mode) with the exact per-key mask: CFG batch on dp=2, heads on tp=4; and the
    joint text+video sequence split 4 ways under ring attention (text padding masked in every chunk)."""
    prompt = 'A shop sign that reads "OPEN" at night'
    dp, sp, tp = mesh
    flags = ["--attention", "splash", "--dp", dp, "--sp", sp, "--tp", tp, "--sp_mode", sp_mode]
    staged, config = staged_latents(tmp_path, prompt, 6.0, *flags)
    assert config["stage2"]["attention"] == "splash" and config["stage2"]["mesh"] == {"dp": dp, "sp": sp, "tp": tp}
    assert config["stage2"]["sequence_parallel"]["mode"] == ("none" if sp == 1 else sp_mode)
    assert relative_error(staged, run_pipeline(reference, prompt, 6.0, "latent")) <= TOLERANCE


@pytest.mark.parametrize("target_size, expected", [(640, (480, 848, 5.0)), (960, (720, 1280, 9.0))])
def test_resolution_defaults_follow_the_transformer_target_size(tmp_path, target_size, expected):
    """480p and 720p checkpoints differ in the transformer's target_size; defaults and flow shift follow."""
    import json

    from tpu_video.models import ModelSource, hunyuanvideo15

    files = {"transformer": ("config.json", {"target_size": target_size}), "guider": ("guider_config.json", {})}
    for component, (name, config) in files.items():
        (tmp_path / component).mkdir()
        (tmp_path / component / name).write_text(json.dumps(config))
    index = {
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
        "guider": ["diffusers", "ClassifierFreeGuidance"],
    }
    defaults = hunyuanvideo15.request_defaults(ModelSource(ref="x", location=str(tmp_path), index=index))
    assert (defaults["height"], defaults["width"], defaults["flow_shift"]) == expected
    assert (defaults["num_frames"], defaults["fps"], defaults["guidance_scale"]) == (121, 24, 6.0)  # 6.0: fallback
