"""The staged CogVideoX run against CogVideoXPipeline run eagerly in PyTorch on the same tiny components.

Tolerance: relative error (Frobenius norm) <= 1e-4 in fp32. The only difference between the two runs
is that the transformer executes as XLA (torchax) instead of ATen; fp32 reassociation in its matmuls
and softmax shows up near 1e-6, so 1e-4 leaves room for a few steps of accumulation and nothing more.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import CogVideoXPipeline

import stage1_text_encoder
import stage2_transformer
from helpers import relative_error, run_stage
from tpu_video import models
from tpu_video.engine.decode import LATENTS_WIDTH_SPLIT, decode
from tpu_video.models import cogvideox
from tpu_video.runtime.interface import Timer, TorchRuntime
from utils import STAGE2_FILE, read_config, read_tensors

TOLERANCE = 1e-4
PROMPT = "A panda playing guitar in the forest"
NEGATIVE = "blurry"
REQUEST = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4, "seed": 7}


@pytest.fixture(scope="module")
def reference_pipelines():
    """The presets' own saved components, loaded back as a stock diffusers pipeline in fp32."""
    return {
        preset: CogVideoXPipeline.from_pretrained(models.materialize_preset(preset), dtype=torch.float32)
        for preset in ("tiny-cogvideox", "tiny-cogvideox1.0")
    }


def run_pipeline(pipe, guidance_scale: float, output_type: str):
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_frames=REQUEST["num_frames"],
        num_inference_steps=REQUEST["num_inference_steps"],
        guidance_scale=guidance_scale,
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        max_sequence_length=pipe.transformer.config.max_text_seq_length,
        output_type=output_type,
    ).frames


@pytest.mark.parametrize("guidance_scale", [6.0, 1.0], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("preset", ["tiny-cogvideox", "tiny-cogvideox1.0"], ids=["v1.5", "v1.0"])
def test_staged_latents_and_frames_vs_pipeline(tmp_path, reference_pipelines, preset, guidance_scale):
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    run_stage(
        stage1_text_encoder,
        [
            "--model",
            preset,
            "--prompt",
            PROMPT,
            "--negative_prompt",
            NEGATIVE,
            "--dtype",
            "fp32",
            "--guidance_scale",
            guidance_scale,
            "--output_dir",
            tmp_path,
            *flags,
        ],
    )
    run_stage(stage2_transformer, ["--input_dir", tmp_path])
    config = read_config(tmp_path, needs="stage2")
    staged = read_tensors(tmp_path, config["stage2"])["latents"]

    pipe = reference_pipelines[preset]
    expected = run_pipeline(pipe, guidance_scale, "latent")  # (B, F, C, H, W), 1.5 keeps its pad frame
    pad = config["stage2"]["dropped_pad_latent_frames"]
    assert pad == (1 if preset == "tiny-cogvideox" else 0)
    expected = expected[:, pad:].permute(0, 2, 1, 3, 4)
    assert staged.shape == expected.shape and staged.dtype == torch.float32
    assert relative_error(staged, expected) <= TOLERANCE

    source, family = models.resolve_model(preset)
    frames = decode(
        family, source, staged, family.latents_normalization(source), torch.float32, TorchRuntime("cpu"), Timer()
    )
    expected_frames = torch.from_numpy(run_pipeline(pipe, guidance_scale, "np")[0])
    assert frames.shape == expected_frames.shape == (9, 64, 96, 3)
    assert relative_error(frames, expected_frames) <= TOLERANCE


@pytest.mark.parametrize("width_split", [1, 8], ids=["one-device", "width-over-8-devices"])
def test_torchax_decode_matches_torch_decode(width_split):
    """Stage 3's two backends decode the same latents to the same frames (fp32, same tolerance), also
    with the activations split along width over 8 devices as stage 3 does (latent width 16)."""
    import sharding
    from tpu_video.runtime import placement
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    source, family = models.resolve_model("tiny-cogvideox")
    latents = torch.randn(1, 4, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    on_torch = decode(
        family, source, latents, family.latents_normalization(source), torch.float32, TorchRuntime("cpu"), Timer()
    )
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=width_split)))
    placed = runtime.to_device(latents, LATENTS_WIDTH_SPLIT).jax()
    assert placed.addressable_shards[0].data.shape[-1] == 16 // width_split
    on_torchax = decode(family, source, latents, family.latents_normalization(source), torch.float32, runtime, Timer())
    assert relative_error(on_torchax, on_torch) <= TOLERANCE


def test_stage2_override_is_applied_and_recorded(tmp_path):
    """Rerunning stage 2 with a new seed changes the latents and records the override."""
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    run_stage(
        stage1_text_encoder,
        ["--model", "tiny-cogvideox", "--prompt", PROMPT, "--dtype", "fp32", "--output_dir", tmp_path, *flags],
    )
    run_stage(stage2_transformer, ["--input_dir", tmp_path])
    first = read_tensors(tmp_path, read_config(tmp_path)["stage2"])["latents"]
    run_stage(stage2_transformer, ["--input_dir", tmp_path, "--seed", "8", "--num_inference_steps", "3"])
    config = read_config(tmp_path)
    assert config["seed"] == 8 and config["num_inference_steps"] == 3
    assert config["stage2"]["overrides"] == {"seed": [7, 8], "num_inference_steps": [4, 3]}
    second = read_tensors(tmp_path, config["stage2"])["latents"]
    assert relative_error(second, first) > 1e-2
    assert (tmp_path / STAGE2_FILE).is_file()


def test_tiny_presets_are_the_two_variants():
    for preset, expected in (("tiny-cogvideox", "1.5"), ("tiny-cogvideox1.0", "1.0")):
        source, family = models.resolve_model(preset)
        assert family is cogvideox
        assert cogvideox.config.variant(source.load_config("transformer")) == expected
