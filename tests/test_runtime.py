"""Runtime behaviour of the stages: warmup, the persistent compilation cache, timing records, previews."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image

import stage2_transformer
import stage3_vae_decoder
from helpers import run_script, run_stage, tiny_stage1
from tpu_video.runtime.interface import Timer
from tpu_video.workarounds.jax import with_cpu_platform
from utils import STAGE2_FILE, read_config, read_tensors

STEPS = 3


@pytest.fixture(scope="module")
def stage1_dir(tmp_path_factory):
    return tiny_stage1(tmp_path_factory.mktemp("stage1"), "--num_inference_steps", STEPS)


def stage2_latents(stage1_dir, out, *flags):
    run_stage(stage2_transformer, ["--input_dir", stage1_dir, "--output_dir", out, *flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config["stage2"]


def test_warmup_does_not_change_the_result(stage1_dir, tmp_path):
    off = ("--executables", "off")  # both runs build their programs (none is loaded)
    cold, cold_info = stage2_latents(stage1_dir, tmp_path / "cold", "--warmup_steps", 0, *off)
    warm, warm_info = stage2_latents(stage1_dir, tmp_path / "warm", "--warmup_steps", 3, *off)
    assert torch.equal(cold, warm)
    assert "warmup" not in cold_info["seconds"] and warm_info["seconds"]["warmup"] > 0
    for info in (cold_info, warm_info):  # the programs are built in the first step without a warmup
        assert info["seconds"]["trace"] > 0 and info["seconds"]["compile"] > 0
    assert warm_info["warmup_steps"] == 3


@pytest.mark.parametrize(
    "platforms, expected",
    [("cuda", "cuda,cpu"), ("tpu", "tpu,cpu"), ("cuda,cpu", "cuda,cpu"), ("cpu", "cpu"), ("", ""), (None, None)],
)
def test_an_accelerator_only_platform_list_keeps_the_cpu_backend(platforms, expected):
    """JAX runs host callbacks (the in-graph mask checks) on a CPU device: JAX_PLATFORMS=cuda alone broke
    stage 2 on an H100 (workarounds.jax.keep_cpu_backend appends cpu before the backends start)."""
    assert with_cpu_platform(platforms) == expected


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "HIGHEST"), (torch.bfloat16, "DEFAULT")])
def test_torchax_runs_fp32_matmuls_at_full_precision(dtype, precision):
    """JAX's DEFAULT lets f32 dots run in TF32 on NVIDIA GPUs (6.1e-4 off the CPU's fp32 latents on an
    H100); the stages trace under runtime.precision(dtype), which asks for HIGHEST in fp32 only."""
    import jax
    import jax.numpy as jnp

    import sharding
    from tpu_video.runtime import placement
    from tpu_video.runtime.interface import TorchRuntime
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(1, 1, 1)))
    x = jnp.ones((4, 4), jnp.float32)
    with runtime.precision(dtype):
        text = jax.jit(jnp.dot).lower(x, x).as_text()
    assert f"precision = [{precision}, {precision}]" in text
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # as a caller that allowed TF32 / bf16 passes would
    try:
        with TorchRuntime().precision(dtype):
            assert torch.get_float32_matmul_precision() == ("highest" if dtype == torch.float32 else "medium")
        assert torch.get_float32_matmul_precision() == "medium"  # put back
    finally:
        torch.set_float32_matmul_precision(previous)


def test_timer_phases_accumulate_and_other_is_the_rest():
    """On a scripted clock: a phase entered twice adds up, `other` is what no phase covered."""
    ticks = iter([0.0, 1.0, 3.0, 4.0, 10.0, 10.5, 11.0, 12.0])
    timer = Timer(clock=lambda: next(ticks))  # starts at 0.0
    with timer.phase("load"):  # 1.0 -> 3.0
        pass
    with timer.phase("denoise"):  # 4.0 -> 10.0
        pass
    with timer.phase("load"):  # 10.5 -> 11.0
        pass
    assert timer.finish() == {"load": 2.5, "denoise": 6.0, "other": 3.5, "total": 12.0}  # finish at 12.0


def test_stage2_timing_section_is_complete(stage1_dir, tmp_path):
    _, info = stage2_latents(stage1_dir, tmp_path)
    seconds = info["seconds"]
    phases = ["read", "load", "place", "trace", "compile", "executables", "warmup", "denoise", "save", "other", "total"]
    assert list(seconds) == phases
    assert all(isinstance(value, float) and value >= 0 for value in seconds.values())
    assert len(info["step_seconds"]) == STEPS and all(step > 0 for step in info["step_seconds"])
    assert info["sha256"] and info["mesh"] == {"dp": 2, "sp": 1, "tp": 4}
    assert {"platform", "device_kind", "device_count", "backend", "versions"} <= set(info)
    assert {"torch", "jax", "torchax", "diffusers"} <= set(info["versions"])


def test_profile_writes_a_trace(stage1_dir, tmp_path):
    stage2_latents(stage1_dir, tmp_path / "out", "--profile", tmp_path / "trace", "--warmup_steps", 1)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_compile_cache_is_filled_then_hit_across_processes(stage1_dir, tmp_path):
    """Two fresh processes with the same shapes: the first compiles and stores, the second loads (without
    the executable store, whose programs skip the compilation cache: workarounds.jax)."""
    cache = tmp_path / "cache"
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    runs = []
    for name in ("first", "second"):
        result = run_script(
            "stage2_transformer.py",
            ["--input_dir", stage1_dir, "--output_dir", tmp_path / name, "--warmup_steps", 1, "--executables", "off"],
            env_overrides=env,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr
        runs.append(json.loads((tmp_path / name / "generation_config.json").read_text())["stage2"]["compile_cache"])
        if name == "first":
            assert any(path.is_file() for path in cache.rglob("*")), "the first run stored nothing"
    assert runs[0]["enabled"] and runs[0]["misses"] > 0 and runs[0]["hits"] == 0
    assert runs[1]["hits"] > 0 and runs[1]["misses"] == 0
    assert f"{runs[1]['hits']} hits, 0 misses" in result.stdout

    result = run_script(
        "stage2_transformer.py",
        ["--input_dir", stage1_dir, "--output_dir", tmp_path / "off", "--no_compile_cache"],
        env_overrides={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "unused")},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    # JAX may create the folder named by the variable at import; nothing may be stored in it.
    assert not [path for path in (tmp_path / "unused").rglob("*") if path.is_file()]
    off = json.loads((tmp_path / "off" / "generation_config.json").read_text())["stage2"]["compile_cache"]
    assert off == {"enabled": False, "hits": 0, "misses": 0}


@pytest.mark.parametrize("count, grid", [(8, (2, 4)), (3, (1, 3)), (20, (3, 4))])
def test_preview_png_is_a_grid_of_evenly_spaced_frames(stage1_dir, tmp_path, count, grid):
    run_stage(stage2_transformer, ["--input_dir", stage1_dir, "--output_dir", tmp_path])
    run_stage(stage3_vae_decoder, ["--input_dir", tmp_path, "--preview_frames", count])
    stage3 = read_config(tmp_path)["stage3"]
    rows, columns = grid
    frames = min(count, stage3["frames"])  # 9 frames: asking for 20 gives all 9
    assert stage3["preview_grid"] == [rows, columns] and rows * columns >= frames > (rows - 1) * columns
    with Image.open(tmp_path / stage3["preview"]) as image:
        assert image.size == (columns * stage3["width"], rows * stage3["height"])
        assert image.mode == "RGB"


def test_no_preview_when_disabled(stage1_dir, tmp_path):
    run_stage(stage2_transformer, ["--input_dir", stage1_dir, "--output_dir", tmp_path])
    run_stage(stage3_vae_decoder, ["--input_dir", tmp_path, "--preview_frames", 0])
    assert "preview" not in read_config(tmp_path)["stage3"]
    assert not list(tmp_path.glob("*.png"))
    assert os.path.exists(tmp_path / STAGE2_FILE)


def test_stage3_takes_a_new_fps_without_rerunning_stage2(stage1_dir, tmp_path):
    """fps shapes only the mp4: a stage-3 override is applied and recorded, not reported as stale latents."""
    from helpers import read_mp4

    run_stage(stage2_transformer, ["--input_dir", stage1_dir, "--output_dir", tmp_path])
    run_stage(stage3_vae_decoder, ["--input_dir", tmp_path, "--fps", 12])
    config = read_config(tmp_path, needs="stage3")
    assert config["fps"] == 12 and config["stage3"]["overrides"] == {"fps": [8, 12]}
    meta, _ = read_mp4(tmp_path / config["stage3"]["file"])
    assert meta["fps"] == 12
