"""Wan 2.1 and 2.2 against WanPipeline run eagerly in PyTorch on the tiny presets, and the pieces around it.

Tolerances: the stock transformer jitted (and sharded) against eager, 1e-5 relative in fp32; the staged
run against the pipeline, 1e-4 relative (Frobenius) in fp32, as for the other families: the staged run
batches [cond, uncond] as one batch of 2 where the pipeline makes two batch-1 calls.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import sharding
import stage1_text_encoder
import stage2_transformer
from helpers import (
    Sample,
    attention_plan,
    expect_user_error,
    read_mp4,
    relative_error,
    run_stage,
    run_stages,
    stop_stage2_after,
)
from tpu_video import models
from tpu_video.engine.decode import decode
from tpu_video.models import wan
from tpu_video.runtime import placement
from tpu_video.runtime.interface import Timer, TorchRuntime
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from utils import CHECKPOINT_FILE, CONFIG_FILE, STAGE2_FILE, VIDEO_FILE, read_config, read_tensors

TOLERANCE = 1e-4
NEGATIVE = "blurry"
REQUEST = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 6, "seed": 7}


# The stock transformer under jit ---------------------------------------------------------------------


def transformer_inputs(batch: int):
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 16, 3, 4, 6, generator=generator),
        "timestep": torch.tensor([700] * batch),
        "encoder_hidden_states": torch.randn(batch, wan.transformer.MAX_SEQUENCE_LENGTH, 32, generator=generator),
    }


@pytest.mark.parametrize(
    "mesh, batch, attention, sp_mode",
    [
        ((1, 1, 1), 1, "xla", "auto"),
        ((1, 1, 8), 1, "xla", "auto"),
        ((2, 1, 4), 2, "splash", "auto"),
        ((1, 2, 4), 2, "xla", "auto"),
        ((1, 8, 1), 2, "splash", "auto"),  # Ulysses over 8 for self- and cross-attention
        ((1, 4, 2), 2, "xla", "auto"),
        ((1, 4, 2), 2, "splash", "ring"),  # ring for self-attention; the text keys stay whole
        ((1, 8, 1), 2, "xla", "ring"),
    ],
    ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value),
)
def test_stock_transformer_jitted_and_sharded_equals_eager(mesh, batch, attention, sp_mode):
    """The rotary embedding's in-place strided writes (`out[..., 0::2] = ...`) compile correctly here,
    at batch 1 unsharded too (where CogVideoX's in-place slice write did not): no patch is needed."""
    with torch.no_grad():
        expected = wan.presets.tiny_transformer()(**transformer_inputs(batch), return_dict=False)[0]
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(*mesh)))
    rules = wan.transformer_rules("megatron").nested("transformer.")
    compiled = runtime.compile(Sample(wan.presets.tiny_transformer()), rules)
    heads = wan.presets.tiny_transformer().config.num_attention_heads
    plan = attention_plan(attention, runtime.mesh, heads=heads, sp_mode=sp_mode)
    with attention_backend(runtime.env, plan, runtime.mesh):
        got = runtime.to_host(compiled(**runtime.to_device(transformer_inputs(batch))))
    assert relative_error(got, expected) <= 1e-5


# Staged runs against the pipeline --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelines():
    from diffusers import WanPipeline

    return {
        preset: WanPipeline.from_pretrained(models.materialize_preset(preset), dtype=torch.float32)
        for preset in ("tiny-wan2.1", "tiny-wan2.2")
    }


def run_pipeline(pipe, guidance_scale: float, output_type: str, guidance_scale_2=None, prompt="a cat playing guitar"):
    return pipe(
        prompt=prompt,
        negative_prompt=NEGATIVE,
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type=output_type,
        **{key: value for key, value in REQUEST.items() if key != "seed"},
    ).frames


def staged(out, preset: str, guidance_scale: float, *stage2_flags, prompt="a cat playing guitar"):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    argv = ["--model", preset, "--prompt", prompt, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--guidance_scale", guidance_scale, "--output_dir", out, *flags])
    run_stage(stage2_transformer, ["--input_dir", out, *stage2_flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config


def check_frames(preset, latents, config, expected_frames):
    source, family = models.resolve_model(preset)
    normalization = config["stage2"]["latents_normalization"]
    frames = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    expected_frames = torch.from_numpy(expected_frames)
    assert frames.shape == expected_frames.shape == (5, 32, 48, 3)
    assert relative_error(frames, expected_frames) <= TOLERANCE


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_wan21_latents_and_frames_vs_pipeline(tmp_path, pipelines, guidance_scale):
    latents, config = staged(tmp_path, "tiny-wan2.1", guidance_scale)
    stage2 = config["stage2"]
    assert stage2["classifier_free_guidance"] == (guidance_scale > 1) and stage2["experts"] == ["transformer"]
    assert stage2["scheduler"] == "UniPCMultistepScheduler" and stage2["latents_normalization"]["method"] == "mean_std"
    expected = run_pipeline(pipelines["tiny-wan2.1"], guidance_scale, "latent")
    assert latents.shape == expected.shape == (1, 16, 2, 4, 6)
    assert relative_error(latents, expected) <= TOLERANCE
    check_frames("tiny-wan2.1", latents, config, run_pipeline(pipelines["tiny-wan2.1"], guidance_scale, "np")[0])


def test_wan22_two_experts_switch_where_the_pipeline_switches(tmp_path, pipelines):
    """Boundary 875 on the 6-step schedule [999, 937, 857, ...]: expert 2 from step 2, with its own scale."""
    latents, config = staged(tmp_path, "tiny-wan2.2", 5.0, "--guidance_scale_2", 2.0)
    stage2 = config["stage2"]
    assert stage2["experts"] == ["transformer", "transformer_2"] and stage2["expert_2_from_step"] == 2
    assert stage2["boundary_timestep"] == 875.0 and config["guidance_scale_2"] == 2.0
    pipe = pipelines["tiny-wan2.2"]
    expected = run_pipeline(pipe, 5.0, "latent", guidance_scale_2=2.0)
    assert relative_error(latents, expected) <= TOLERANCE
    # Both scales matter: the pipeline with one scale is far from this run.
    assert relative_error(latents, run_pipeline(pipe, 5.0, "latent")) > 10 * TOLERANCE
    check_frames("tiny-wan2.2", latents, config, run_pipeline(pipe, 5.0, "np", guidance_scale_2=2.0)[0])


@pytest.mark.parametrize("mesh", [(2, 1, 4), (1, 8, 1)], ids=["2x1x4", "1x8x1-ulysses"])
def test_wan22_splash_on_a_mesh_vs_pipeline(tmp_path, pipelines, mesh):
    """CFG on dp and heads on tp; and the video tokens split 8 ways under Ulysses (8 heads, one per device)."""
    dp, sp, tp = mesh
    latents, config = staged(tmp_path, "tiny-wan2.2", 4.0, "--attention", "splash", "--dp", dp, "--sp", sp, "--tp", tp)
    assert config["stage2"]["attention"] == "splash" and config["stage2"]["mesh"] == {"dp": dp, "sp": sp, "tp": tp}
    assert config["stage2"]["sequence_parallel"]["mode"] == ("none" if sp == 1 else "ulysses")
    assert relative_error(latents, run_pipeline(pipelines["tiny-wan2.2"], 4.0, "latent")) <= TOLERANCE


def test_flow_shift_comes_from_the_scheduler_and_is_overridable(tmp_path, pipelines):
    latents, config = staged(tmp_path, "tiny-wan2.1", 5.0, "--flow_shift", 5.0)
    assert config["stage2"]["overrides"]["flow_shift"] == [3.0, 5.0]  # 3.0: the folder's scheduler config
    pipe = pipelines["tiny-wan2.1"]
    pipe.scheduler.register_to_config(flow_shift=5.0)
    try:
        expected = run_pipeline(pipe, 5.0, "latent")
    finally:
        pipe.scheduler.register_to_config(flow_shift=3.0)
    assert relative_error(latents, expected) <= TOLERANCE


def test_checkpoint_before_the_expert_switch_resumes_bit_identically(tmp_path, monkeypatch):
    """Stopped after step 1 of 6 (expert 2 takes over at step index 2): the checkpoint carries UniPC's history;
    the resumed run crosses the switch and ends bit-identical to an uninterrupted run."""
    full, _ = staged(tmp_path / "full", "tiny-wan2.2", 5.0, "--guidance_scale_2", 3.0)
    out = tmp_path / "stopped"
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    run_stage(
        stage1_text_encoder,
        [
            "--model",
            "tiny-wan2.2",
            "--prompt",
            "a cat playing guitar",
            "--negative_prompt",
            NEGATIVE,
            "--dtype",
            "fp32",
            "--guidance_scale",
            5.0,
            "--output_dir",
            out,
            *flags,
        ],
    )
    stop_stage2_after(monkeypatch, ["--input_dir", out, "--guidance_scale_2", "3.0"], steps=1)
    from safetensors.torch import load_file

    saved = load_file(str(out / CHECKPOINT_FILE))
    assert "scheduler.model_outputs.1" in saved and int(saved["scheduler.lower_order_nums"]) == 1

    run_stage(stage2_transformer, ["--input_dir", out, "--guidance_scale_2", 3.0, "--resume"])
    assert torch.equal(read_tensors(out, read_config(out)["stage2"])["latents"], full)
    assert not (out / CHECKPOINT_FILE).exists()


# Requests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_frames", "6"], "--num_frames 6 must be 4n+1"),
        (["--height", "40"], "--height 40 must be a positive multiple of 16"),
        (["--guidance_scale_2", "3"], "--guidance_scale_2 applies to two-expert models"),
    ],
)
def test_wan21_request_errors_before_loading(capsys, tmp_path, flags, message, no_weights_loaded):
    argv = ["--model", "tiny-wan2.1", "--prompt", "x", "--output_dir", tmp_path, *flags]
    expect_user_error(capsys, stage1_text_encoder, argv, message)


def test_guidance_scale_2_is_refused_by_single_transformer_families(capsys, tmp_path):
    argv = ["--model", "tiny-cogvideox", "--prompt", "x", "--output_dir", tmp_path, "--guidance_scale_2", "3"]
    expect_user_error(capsys, stage1_text_encoder, argv, "--guidance_scale_2 is an option of wan (Wan 2.2 A14B")


def test_published_defaults_and_experts():
    source, family = models.resolve_model("Wan-AI/Wan2.2-T2V-A14B-Diffusers", configs_only=True)
    assert family is wan and wan.transformer_components(source) == ("transformer", "transformer_2")
    defaults = wan.request_defaults(source)
    assert (defaults["height"], defaults["width"], defaults["num_frames"], defaults["fps"]) == (480, 832, 81, 16)
    source, _ = models.resolve_model("Wan-AI/Wan2.1-T2V-14B-Diffusers", configs_only=True)
    assert wan.transformer_components(source) == ("transformer",)


# Stage 3 and the CLI ---------------------------------------------------------------------------------


def test_wan_vae_decode_under_torchax_equals_torch():
    """The Wan VAE's frame-by-frame causal cache (Python lists, a static frame loop) traces as it is."""
    source, family = models.resolve_model("tiny-wan2.1")
    latents = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(3))
    normalization = wan.latents_normalization(source)
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=8)))
    got = decode(family, source, latents, normalization, torch.float32, runtime, Timer())
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.slow
def test_wan22_from_a_saved_folder_through_the_cli(tmp_path):
    """In this process, through each stage's main(), as tests/test_cli_real_loading.py does."""
    folder = tmp_path / "tiny-wan2.2-saved"
    wan.presets.tiny_pipeline("2.2", seed=4).save_pretrained(folder)
    out = tmp_path / "stage_outputs"
    request = ["--height", "48", "--width", "64", "--num_frames", "9", "--num_inference_steps", "4"]
    steps = [
        ("stage1_text_encoder.py", ["--model", folder, "--prompt", "a red cat", "--output_dir", out, *request]),
        ("stage2_transformer.py", ["--input_dir", out, "--guidance_scale_2", "3"]),
        ("stage3_vae_decoder.py", ["--input_dir", out, "--backend", "torchax"]),
    ]
    run_stages(steps)
    meta, frames = read_mp4(out / VIDEO_FILE)
    assert tuple(meta["size"]) == (64, 48) and meta["fps"] == 16  # the pipeline's 16 fps
    assert len(frames) == 9 and np.std(np.stack(frames)) > 1.0
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["model_family"] == "wan" and config["stage2"]["experts"] == ["transformer", "transformer_2"]
    assert config["stage2"]["tensors"]["latents"] == {"shape": [1, 16, 3, 6, 8], "dtype": "float32"}
    assert (out / STAGE2_FILE).exists() and config["stage3"]["backend"] == "torchax"
