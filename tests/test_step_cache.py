"""Step caching (tpu_video/engine/step_cache.py) against its definitions.

MagCache: our staged run equals the eager diffusers pipeline with `transformer.enable_cache(
MagCacheConfig(...))` on the same tiny components, with the same steps skipped, fp32, 1e-4 relative (as
every staged-vs-pipeline test: the only difference is XLA vs ATen arithmetic over a few steps); our
calibration equals diffusers' (1e-5). Where our ratios differ per branch, diffusers is given one config
per cache context (it has one per transformer; `per_context_configs`). HunyuanVideo-1.5's block is
registered with diffusers' registry as workarounds.diffusers.register_hunyuanvideo15_block does.

The interval cache equals a plain-PyTorch reference written from its definition (`IntervalReference`,
hooks on the eager pipeline's blocks), 1e-4; with an interval of 1 it equals the uncached run (1e-6).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import helpers
import stage1_text_encoder
import stage2_transformer
from cache_reference import IntervalReference, computed_calls, mag_config, per_context_configs
from helpers import expect_user_error, relative_error, run_stage
from tpu_video import models
from tpu_video.cli import Stopped, run_ended
from tpu_video.engine import cache_schedule
from tpu_video.engine.cache_schedule import CacheSettings, schedule
from tpu_video.engine.guard import DenoiseGuard
from tpu_video.engine.mag_ratios import MAG_RATIOS_FILE
from utils import CHECKPOINT_FILE, read_config, read_tensors

TOLERANCE = 1e-4
NEGATIVE = "blurry"
PROMPT = "a cat playing guitar"
COGVIDEOX = {"height": 64, "width": 96, "num_frames": 9}  # its VAE needs 8n+1 frames


def stage1(out, model, steps: int, guidance_scale: float = 6.0, **request):
    request = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": steps, "seed": 7, **request}
    flags = [f"--{key}={value}" for key, value in request.items()]
    argv = ["--model", model, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--guidance_scale", guidance_scale, "--output_dir", out, *flags])
    return request


def stage2(out, *flags):
    run_stage(stage2_transformer, ["--input_dir", out, *flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config["stage2"]


def pipeline_latents(pipe, request, guidance_scale: float = 6.0, **extra):
    kwargs = {key: request[key] for key in ("height", "width", "num_frames", "num_inference_steps")}
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        guidance_scale=guidance_scale,
        generator=torch.Generator("cpu").manual_seed(request["seed"]),
        output_type="latent",
        **kwargs,
        **extra,
    ).frames


def printed_calibrations(text: str) -> list[list[float]]:
    """The ratio lists diffusers' MagCache prints when a calibration run ends, in order."""
    lines = text.splitlines()
    found = [lines[i + 1] for i, line in enumerate(lines) if "[MagCache] Calibration Complete" in line]
    return [json.loads(line) for line in found]


# The host-side schedules --------------------------------------------------------------------------------


def test_interval_schedule_is_the_reference_definition():
    settings = CacheSettings(kind="interval", start_step=11, end_step=45, step_interval=4)
    plan = schedule(settings, [0] * 50, ("transformer",), ("batch",))
    expected = [not (i < 11 or i >= 45 or (i - 11) % 4 == 0) for i in range(50)]
    assert [reuse[0] for reuse in plan] == expected and sum(expected) == 25
    # A second expert has no residual at its first step, so that step computes.
    two = schedule(
        CacheSettings(kind="interval", start_step=1, end_step=6, step_interval=4),
        [0, 0, 0, 1, 1, 1],
        ("a", "b"),
        ("c",),
    )
    assert cache_schedule.schedule_text(two) == "FFCFCF"


@pytest.mark.parametrize("window", [(11, 45, 4), (3, 2, 1), (0, 5, 0)])
def test_interval_window_that_does_not_fit_is_an_error(window):
    settings = CacheSettings(kind="interval", start_step=window[0], end_step=window[1], step_interval=window[2])
    with pytest.raises(cache_schedule.UserError, match="do not fit 8 steps"):
        schedule(settings, [0] * 8, ("transformer",), ("batch",))


# MagCache ----------------------------------------------------------------------------------------------


def test_cogvideox_magcache_equals_diffusers_and_skips_the_same_steps(tmp_path):
    from diffusers import CogVideoXPipeline

    ratios = [1.0, 1.02, 0.99, 1.01, 1.0, 0.98, 1.03, 1.0]
    request = stage1(tmp_path, "tiny-cogvideox", 8, **COGVIDEOX)
    (tmp_path / "ratios.json").write_text(json.dumps(ratios))
    latents, section = stage2(
        tmp_path, "--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_threshold", 0.05
    )

    pipe = CogVideoXPipeline.from_pretrained(models.materialize_preset("tiny-cogvideox"), dtype=torch.float32)
    calls = computed_calls(pipe.transformer)
    pipe.transformer.enable_cache(mag_config(ratios, 8, threshold=0.05))
    expected = pipeline_latents(pipe, request, max_sequence_length=32)[:, 1:].permute(0, 2, 1, 3, 4)
    cache = section["step_cache"]
    assert cache["schedule"] == "".join("F" if ran else "C" for ran in calls) == "FFCCCFCF"
    assert cache["reused_steps"] == {"transformer.cond_uncond": [2, 3, 4, 6]}
    assert cache["computed_steps"] == 4 and cache["cached_steps"] == 4
    assert set(section) >= {"step_seconds"} and "median cached step" in cache
    assert relative_error(latents, expected) <= TOLERANCE


def test_cogvideox_calibration_equals_diffusers_and_is_used_by_the_next_run(tmp_path, capsys):
    from diffusers import CogVideoXPipeline

    request = stage1(tmp_path, "tiny-cogvideox1.0", 4, **COGVIDEOX)
    uncached, _ = stage2(tmp_path)
    calibrated, _ = stage2(tmp_path, "--cache_calibrate")
    written = json.loads((tmp_path / MAG_RATIOS_FILE).read_text())
    assert written["model"] == "tiny-cogvideox1.0" and list(written["mag_ratios"]) == ["transformer.cond_uncond"]
    assert relative_error(calibrated, uncached) <= 1e-6  # calibration computes every step

    pipe = CogVideoXPipeline.from_pretrained(models.materialize_preset("tiny-cogvideox1.0"), dtype=torch.float32)
    pipe.transformer.enable_cache(mag_config([], 4, calibrate=True))
    capsys.readouterr()
    pipeline_latents(pipe, request, max_sequence_length=32)
    (expected,) = printed_calibrations(capsys.readouterr().out)
    ours = written["mag_ratios"]["transformer.cond_uncond"]
    assert len(ours) == 4 and ours[0] == expected[0] == 1.0
    assert relative_error(ours, expected) <= 1e-5

    _, section = stage2(tmp_path, "--cache", "magcache", "--cache_retention_ratio", 0, "--cache_threshold", 1e9)
    assert section["step_cache"]["mag_ratios"] == written["mag_ratios"]  # picked up from the folder
    assert section["step_cache"]["schedule"] == "FCCC"


def test_wan22_calibration_and_per_branch_magcache_equal_diffusers(tmp_path, capsys):
    """Two experts (steps 0-1 and 2-5) times two branches: four cache states, each configured over its
    own calls; the ratios below make step 3 partial (cond reuses, uncond computes)."""
    from diffusers import WanPipeline

    request = stage1(tmp_path, "tiny-wan2.2", 6, guidance_scale=5.0)
    stage2(tmp_path, "--cache_calibrate")
    ours = json.loads((tmp_path / MAG_RATIOS_FILE).read_text())["mag_ratios"]
    pipe = WanPipeline.from_pretrained(models.materialize_preset("tiny-wan2.2"), dtype=torch.float32)
    for transformer, calls in ((pipe.transformer, 2), (pipe.transformer_2, 4)):
        transformer.enable_cache(mag_config([], calls, calibrate=True))
    capsys.readouterr()
    pipeline_latents(pipe, request, guidance_scale=5.0)
    printed = printed_calibrations(capsys.readouterr().out)
    names = ["transformer.cond", "transformer.uncond", "transformer_2.cond", "transformer_2.uncond"]
    assert list(ours) == names and [len(ours[name]) for name in names] == [2, 2, 4, 4]
    for name, expected in zip(names, printed, strict=True):
        assert relative_error(ours[name], expected) <= 1e-5, name

    ratios = {
        "transformer.cond": [1.0, 1.0],
        "transformer.uncond": [1.0, 1.01],
        "transformer_2.cond": [1.0, 1.0, 1.0, 1.0],
        "transformer_2.uncond": [1.0, 1.2, 1.0, 1.0],
    }
    (tmp_path / "ratios.json").write_text(json.dumps({"mag_ratios": ratios}))
    flags = ["--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_retention_ratio", 0]
    latents, section = stage2(tmp_path, *flags)
    assert section["step_cache"]["schedule"] == "FCFPCC"

    pipe = WanPipeline.from_pretrained(models.materialize_preset("tiny-wan2.2"), dtype=torch.float32)
    calls = {}
    for component in ("transformer", "transformer_2"):
        transformer = getattr(pipe, component)
        calls[component] = computed_calls(transformer)
        configs = {
            branch: mag_config(ratios[f"{component}.{branch}"], len(ratios[f"{component}.{branch}"]), retention_ratio=0)
            for branch in ("cond", "uncond")
        }
        per_context_configs(transformer, configs)
    expected = pipeline_latents(pipe, request, guidance_scale=5.0)
    ran = calls["transformer"] + calls["transformer_2"]  # cond, uncond per step
    reused = {name: [] for name in names}
    for call, computed in enumerate(ran):
        step, branch = divmod(call, 2)
        if not computed:
            reused[f"{'transformer' if step < 2 else 'transformer_2'}.{('cond', 'uncond')[branch]}"].append(step)
    assert section["step_cache"]["reused_steps"] == reused
    assert reused == {
        "transformer.cond": [1],
        "transformer.uncond": [1],
        "transformer_2.cond": [3, 4, 5],
        "transformer_2.uncond": [4, 5],
    }
    assert relative_error(latents, expected) <= TOLERANCE


def test_hunyuanvideo15_magcache_equals_diffusers_with_the_block_registered(tmp_path):
    from tpu_video.workarounds.diffusers import register_hunyuanvideo15_block

    ratios = [1.0, 1.0, 1.0, 1.0]
    request = stage1(tmp_path, "tiny-hunyuanvideo15", 4)
    (tmp_path / "ratios.json").write_text(json.dumps(ratios))
    flags = ["--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_max_skip_steps", 1]
    latents, section = stage2(tmp_path, *flags)
    assert section["step_cache"]["schedule"] == "FCFC"  # retention: int(0.2 * 4 + 0.5) = 1 step

    register_hunyuanvideo15_block()
    pipe = helpers.pipeline("tiny-hunyuanvideo15")
    pipe.guider.guidance_scale = 6.0
    calls = computed_calls(pipe.transformer)
    pipe.transformer.enable_cache(mag_config(ratios, 4, max_skip_steps=1))
    kwargs = {key: request[key] for key in ("height", "width", "num_frames", "num_inference_steps")}
    expected = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        generator=torch.Generator("cpu").manual_seed(request["seed"]),
        output_type="latent",
        **kwargs,
    ).frames
    assert calls == [True, True, False, False, True, True, False, False]  # cond, uncond per step
    assert relative_error(latents, expected) <= TOLERANCE


def test_magcache_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch, capsys):
    """The residual on the device goes into the checkpoint; the resumed run equals the uninterrupted one.
    Also on Splash with the CFG batch on dp and the tokens on sp."""
    ratios = json.dumps([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    stage1(tmp_path, "tiny-cogvideox", 6, **COGVIDEOX)
    (tmp_path / "ratios.json").write_text(ratios)
    flags = ["--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_max_skip_steps", 1]
    flags += ["--attention", "splash", "--dp", 2, "--sp", 2, "--tp", 2]
    full, section = stage2(tmp_path, *flags)
    assert section["step_cache"]["schedule"] == "FCFCFC"

    after_step = DenoiseGuard.after_step

    def stop_after_third_step(self, index, total, tensors, **kwargs):
        self.stop_requested = index == 2  # step 3 computed; step 4 reuses its residual after the resume
        return after_step(self, index, total, tensors, **kwargs)

    monkeypatch.setattr(DenoiseGuard, "after_step", stop_after_third_step)
    with pytest.raises(Stopped, match="after step 3 of 6"):
        try:
            stage2_transformer.main(["--input_dir", str(tmp_path), *map(str, flags)])
        finally:
            run_ended()  # as run_cli: the folder held is let go
    monkeypatch.setattr(DenoiseGuard, "after_step", after_step)
    from safetensors.torch import load_file

    assert "cache.0.hidden" in load_file(str(tmp_path / CHECKPOINT_FILE))
    default_skips = [flag for flag in flags if flag not in ("--cache_max_skip_steps", 1)]  # other cache settings
    argv = ["--input_dir", tmp_path, *default_skips, "--resume"]
    expect_user_error(capsys, stage2_transformer, argv, "belongs to a different request")
    resumed, _ = stage2(tmp_path, *flags, "--resume")
    assert torch.equal(resumed, full)


# The interval cache --------------------------------------------------------------------------------------


def test_interval_cache_equals_its_definition(tmp_path, four_layer_cogvideox):
    from diffusers import CogVideoXPipeline

    request = stage1(tmp_path, four_layer_cogvideox, 8, **COGVIDEOX)
    window = ["--cache_start_step", 1, "--cache_end_step", 7, "--cache_step_interval", 3]
    latents, section = stage2(tmp_path, "--enable_cache", *window)
    assert section["step_cache"]["kind"] == "interval" and section["step_cache"]["schedule"] == "FFCCFCCF"

    pipe = CogVideoXPipeline.from_pretrained(four_layer_cogvideox, dtype=torch.float32)
    IntervalReference(pipe.transformer, 1, 7, 3, steps=8)
    expected = pipeline_latents(pipe, request, max_sequence_length=32)[:, 1:].permute(0, 2, 1, 3, 4)
    assert relative_error(latents, expected) <= TOLERANCE

    uncached, _ = stage2(tmp_path)
    every, section = stage2(
        tmp_path, "--cache", "interval", "--cache_start_step", 0, "--cache_end_step", 8, "--cache_step_interval", 1
    )
    assert section["step_cache"]["schedule"] == "F" * 8
    assert relative_error(every, uncached) <= 1e-6
    assert relative_error(latents, uncached) > 1e-3  # the cache did change the result


# Flags -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache_threshold", "0.1"], "--cache_threshold only applies with --cache magcache"),
        (["--cache", "magcache", "--cache_step_interval", "2"], "only applies with --cache interval"),
        (["--cache", "magcache"], "needs the model's magnitude ratios"),
        (["--enable_cache", "--cache", "magcache"], "--enable_cache means --cache interval"),
        (["--cache", "interval", "--cache_calibrate"], "cannot go with --cache interval"),
        (["--enable_cache"], "do not fit 4 steps"),
        (["--enable_cache", "--cache_end_step", "4", "--cache_start_step", "1"], "needs at least 3 transformer blocks"),
    ],
)
def test_cache_flag_errors(tmp_path, capsys, request, flags, message):
    stage1(tmp_path, "tiny-cogvideox", 4, **COGVIDEOX)
    if "do not fit" in message:  # the window against the request's steps: before any weights load
        request.getfixturevalue("no_weights_loaded")
    expect_user_error(capsys, stage2_transformer, ["--input_dir", tmp_path, *flags], message)


def test_mag_ratios_file_errors(tmp_path, capsys):
    stage1(tmp_path, "tiny-cogvideox", 4, **COGVIDEOX)
    bad = tmp_path / "bad.json"
    bad.write_text('{"mag_ratios": {"transformer.cond_uncond": ["x"]}}')
    expect_user_error(
        capsys,
        stage2_transformer,
        ["--input_dir", tmp_path, "--cache", "magcache", "--cache_mag_ratios", bad],
        "expected a list of numbers",
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "tiny-wan2.1", "mag_ratios": {"transformer.cond": [1.0]}}))
    message = expect_user_error(
        capsys,
        stage2_transformer,
        ["--input_dir", tmp_path, "--cache", "magcache", "--cache_mag_ratios", other],
        "calibrated on tiny-wan2.1",
    )
    assert re.search("not tiny-cogvideox", message)
