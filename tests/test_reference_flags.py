"""What a user coming from the reference scripts types: their flag spellings, their stage-3 flags, their
folders, and the stage-3 backend chosen for the host.

Aliases must give the same config and the same latents as our spellings (compared exactly: same
process, same seed).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, run_script, run_stage
from tpu_video import models
from tpu_video.engine.decode import decode
from tpu_video.runtime.backend import choose_backend
from tpu_video.runtime.interface import Timer, TorchRuntime
from utils import CONFIG_FILE, STAGE1_FILE, STAGE2_FILE, read_config, read_tensors

REQUEST = ["--prompt", "a cat", "--height", "32", "--width", "48", "--num_inference_steps", "2"]


def request_part(folder) -> dict:
    """The config without what differs between two identical runs (timings, where it ran)."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    stage1 = {key: config["stage1"][key] for key in ("file", "sha256", "tensors")}
    keep = ("file", "sha256", "tensors", "request", "overrides", "latents_normalization", "dtype")
    stage2 = {key: config["stage2"][key] for key in keep if "stage2" in config}
    return {**{k: v for k, v in config.items() if not k.startswith("stage")}, "stage1": stage1, "stage2": stage2}


def test_reference_spellings_give_the_same_config_and_latents(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    run_stage(stage1_text_encoder, ["--model", "tiny-cogvideox", "--num_frames", 9, "--dtype", "fp32",
                                    "--output_dir", ours, *REQUEST])  # fmt: skip
    run_stage(stage1_text_encoder, ["--model_id", "tiny-cogvideox", "--frames", 9, "--dtype", "float32",
                                    "--output_dir", theirs, *REQUEST])  # fmt: skip
    run_stage(stage2_transformer, ["--input_dir", ours, "--num_frames", 17, "--model", "tiny-cogvideox"])
    run_stage(stage2_transformer, ["--input_dir", theirs, "--video_length", 17, "--model_id", "tiny-cogvideox"])
    assert request_part(ours) == request_part(theirs)
    assert read_config(ours)["dtype"] == "fp32" and read_config(ours)["stage2"]["overrides"] == {"num_frames": [9, 17]}
    assert (ours / STAGE2_FILE).read_bytes() == (theirs / STAGE2_FILE).read_bytes()


def test_stage1_first_log_lines_say_it_loads_then_name_family_and_model(tmp_path, capsys):
    run_stage(stage1_text_encoder, ["--model", "tiny-hunyuanvideo15", "--output_dir", tmp_path, *REQUEST])
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.endswith("] stage 1: loading torch and diffusers")  # printed before they load
    assert "stage 1 for hunyuanvideo15, model tiny-hunyuanvideo15" in second


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    out = tmp_path_factory.mktemp("encoded")
    run_stage(stage1_text_encoder, ["--model", "tiny-cogvideox", "--dtype", "fp32", "--output_dir", out, *REQUEST])
    return out


@pytest.fixture(scope="module")
def denoised(encoded, tmp_path_factory):
    out = tmp_path_factory.mktemp("denoised")
    run_stage(stage2_transformer, ["--input_dir", encoded, "--output_dir", out])
    return out


def test_enable_profiler_writes_the_trace_where_profiler_output_dir_says(encoded, tmp_path):
    trace = tmp_path / "trace"
    run_stage(stage2_transformer, ["--input_dir", encoded, "--output_dir", tmp_path / "out", "--enable_profiler",
                                   "--profiler_output_dir", trace])  # fmt: skip
    assert any(path.is_file() for path in trace.rglob("*"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--profiler_output_dir", "x"], "--profiler_output_dir needs --enable_profiler (or use --profile DIR)"),
        (["--dp", 8, "--tp", 1], "dp 8 is more than the batch of 2, the two CFG branches"),
        (["--dp", 2, "--tp", 4, "--guidance_scale", 1], "dp 2 is more than the batch of 1, one sample (CFG is off)"),
        (["--dtype", "float64"], "--dtype 'float64' is not one of bf16, fp16, fp32 (or bfloat16, float16, float32)"),
    ],
)
def test_stage2_refusals_come_before_loading(capsys, encoded, tmp_path, flags, message, no_weights_loaded):
    line = expect_user_error(capsys, stage2_transformer, ["--input_dir", encoded, "--output_dir", tmp_path, *flags],
                             message)  # fmt: skip
    if "--dp 8" in " ".join(map(str, flags)):
        assert "a mesh that works: --dp 2 --sp 1 --tp 4" in line
    assert not any(tmp_path.iterdir())


def test_stage3_output_video_and_save_frames(denoised, tmp_path, capsys):
    video = tmp_path / "videos" / "cat.mp4"
    # Pinned to the CPU: --backend auto would decode with torch on CUDA on a GPU host, not the computation below.
    argv = ["--input_dir", denoised, "--output_video", video, "--save_frames", "--backend", "torch", "--device", "cpu"]
    run_stage(stage3_vae_decoder, argv)
    folder = video.parent
    out = capsys.readouterr().out  # every file written is announced, and the folder read first
    assert f"reading {denoised}: cogvideox tiny-cogvideox" in out
    for name in ("cat.mp4", "cat_preview.png", "cat_frames.safetensors"):
        assert f"wrote {folder / name}: " in out
    assert {path.name for path in folder.iterdir()} >= {"cat.mp4", "cat_preview.png", "cat_frames.safetensors"}
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["stage3"]["file"] == "cat.mp4" and config["stage3"]["frames_file"]["file"] == "cat_frames.safetensors"
    saved = read_tensors(folder, config["stage3"]["frames_file"])  # checks the recorded sha256 too
    source, family = models.resolve_model("tiny-cogvideox")
    latents = load_file(str(denoised / STAGE2_FILE))["latents"]
    normalization = read_config(denoised)["stage2"]["latents_normalization"]
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    assert torch.equal(saved["frames_float"], expected)
    assert torch.equal(saved["frames"], (expected * 255).round().to(torch.uint8))
    assert saved["frames"].shape == (9, 32, 48, 3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", 1], "--dp: stage 3 has no data-parallel axis; with --backend torchax it splits the latents' width"),
        (["--output_video", "x.mp4", "--output_name", "y.mp4"], "--output_video names the folder and the file"),
    ],
)
def test_stage3_refusals(capsys, denoised, flags, message):
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", denoised, *flags], message)


@pytest.mark.parametrize(
    "cuda, platform, expected",
    [
        (True, "tpu", ("torch", "cuda")),  # a CUDA GPU for torch wins, JAX is not asked
        (False, "tpu", ("torchax", None)),
        (False, "gpu", ("torchax", None)),
        (False, "cpu", ("torch", "cpu")),
        (False, None, ("torch", "cpu")),  # JAX not installed
    ],
)
def test_auto_backend_choice(cuda, platform, expected):
    asked = []

    def probe():
        asked.append(True)
        return platform

    backend, device, reason = choose_backend("auto", None, cuda=lambda: cuda, platform=probe)
    assert (backend, device) == expected and reason
    assert asked == ([] if cuda else [True])
    assert choose_backend("torch", None, cuda=lambda: True, platform=probe)[:2] == ("torch", None)


@pytest.mark.slow
def test_auto_backend_without_jax_and_with_jax_on_cpu(denoised, tmp_path, jax_blocked):  # noqa: F811
    without = run_script("stage3_vae_decoder.py", ["--input_dir", denoised, "--output_dir", tmp_path / "a"],
                         extra_pythonpath=jax_blocked)  # fmt: skip
    assert without.returncode == 0, without.stderr[-2000:]
    stage3 = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())["stage3"]
    assert stage3["backend"] == "torch" and "JAX is not installed: torch on cpu" in stage3["backend_choice"]
    with_jax = run_script("stage3_vae_decoder.py", ["--input_dir", denoised, "--output_dir", tmp_path / "b"])
    assert with_jax.returncode == 0, with_jax.stderr[-2000:]
    stage3 = json.loads((tmp_path / "b" / CONFIG_FILE).read_text())["stage3"]
    assert stage3["backend"] == "torch" and "JAX sees only cpu: torch on cpu" in stage3["backend_choice"]


def test_a_reference_scripts_folder_is_recognised(capsys, tmp_path):
    (tmp_path / STAGE1_FILE).write_bytes(b"not checked")
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"prompt": "a sunset", "model_id": "some/model"}))
    line = expect_user_error(capsys, stage2_transformer, ["--input_dir", tmp_path], "from the reference scripts")
    assert 'redo stage 1 here: python stage1_text_encoder.py --model some/model --prompt "a sunset"' in line
