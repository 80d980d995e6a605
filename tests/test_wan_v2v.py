"""Wan video-to-video (tpu_video/models/wan/v2v.py): `--video` on a text-to-video Wan folder against diffusers'
WanVideoToVideoPipeline run eagerly on the same tiny components, loaded from the same folder, given the same
frames (decoded from the same mp4 by imageio-ffmpeg).

Tolerance, fp32, relative: 1e-4 for the latents and the decoded frames, as tests/test_wan.py (the staged run
batches [cond, uncond] where the pipeline makes two calls). The video is 9 frames of 40x56 pixels, resized to the
request's 32x48 by the pipeline's processor; strength 0.6 of 5 steps runs the last 3.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from cache_reference import computed_calls, in_contexts, mag_config
from helpers import decoded_frames, expect_user_error, relative_error, run_script, run_stage, write_video
from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.engine.videos import read_video
from utils import read_config, read_tensors

TOLERANCE = 1e-4
ONE_DEVICE = "--xla_force_host_platform_device_count=1"
PROMPT, NEGATIVE, SEED = "a cat playing guitar", "blurry", 3
REQUEST = {"height": 32, "width": 48, "num_inference_steps": 5, "guidance_scale": 4.0}


def flags(values: dict) -> list[str]:
    return [f"--{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("v2v") / "clip.mp4"
    write_video(path)
    return path


def test_video_to_video_matches_the_pipeline(capsys, tmp_path, video_file):
    """Stage 1 reads and VAE-encodes the video (its 9 frames set --num_frames), stage 2 runs the last
    int(5 x 0.6) = 3 steps with Splash on a dp 2 x sp 2 x tp 2 mesh (and again on one device), stage 3
    decodes (torch)."""
    from diffusers import WanVideoToVideoPipeline

    out = tmp_path / "run"
    argv = ["--model", "tiny-wan2.1", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--video", video_file, "--strength", 0.6, "--output_dir", out, *flags(REQUEST)]
    run_stage(stage1_text_encoder, argv)
    mesh = ["--attention", "splash", "--dp", 2, "--sp", 2, "--tp", 2]
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *mesh])
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    assert config["num_frames"] == 9 and config["strength"] == 0.6 and config["stage1"]["task"] == "v2v"
    record = config["stage1"]["inputs"]["video"]
    assert record["kind"] == "video" and record["frames"] == 9 and record["size"] == [40, 56]
    assert record["processed_size"] == [32, 48]

    def v2v_pipeline():
        folder = models.materialize_preset("tiny-wan2.1")
        return WanVideoToVideoPipeline.from_pretrained(folder, torch_dtype=torch.float32)

    pipe = v2v_pipeline()

    def call(output_type, pipe=pipe):
        generator = torch.Generator("cpu").manual_seed(SEED)
        frames = decoded_frames(video_file)
        return pipe(
            video=frames, prompt=PROMPT, negative_prompt=NEGATIVE, strength=0.6, generator=generator,
            output_type=output_type, **REQUEST,
        ).frames  # fmt: skip

    latents = read_tensors(out, config["stage2"])["latents"]
    expected = call("latent")
    assert latents.shape == expected.shape == (1, 16, 3, 4, 6)
    assert relative_error(latents, expected) <= TOLERANCE
    # Stage 2 again in a process of one CPU device (the same stage-1 files, its own output folder).
    one = tmp_path / "one-device"
    argv_one = ["--input_dir", out, "--output_dir", one, "--executables", "off"]
    done = run_script("stage2_transformer.py", argv_one, env_overrides={"XLA_FLAGS": ONE_DEVICE})
    assert done.returncode == 0, done.stderr[-2000:]
    assert relative_error(read_tensors(one, read_config(one)["stage2"])["latents"], expected) <= TOLERANCE
    frames = read_tensors(out, config["stage3"]["frames_file"])["frames_float"]
    expected_frames = torch.from_numpy(call("np")[0])
    assert frames.shape == expected_frames.shape == (9, 32, 48, 3)
    assert relative_error(frames, expected_frames) <= TOLERANCE

    # The same frames as a folder of PNGs: the same stage-1 latents, to the bit (the same computation).
    folder = tmp_path / "frames"
    folder.mkdir()
    for index, frame in enumerate(decoded_frames(video_file)):
        frame.save(folder / f"{index:03d}.png")
    again = [*argv[: argv.index("--video")], "--video", folder, *argv[argv.index("--video") + 2 :]]
    again[again.index("--output_dir") + 1] = tmp_path / "from-frames"
    run_stage(stage1_text_encoder, again)
    from_frames = read_config(tmp_path / "from-frames", needs="stage1")
    assert len(from_frames["stage1"]["inputs"]["video"]["sha256"]) == 64
    latents_of = {
        name: read_tensors(name, read_config(name)["stage1"])["video_latents"]
        for name in (out, tmp_path / "from-frames")
    }
    assert torch.equal(*latents_of.values())
    # A later stage checks an overridden strength as stage 1 does, before any weights load.
    expect_user_error(
        capsys, stage2_transformer, ["--input_dir", out, "--strength", "1.5"], "must be above 0 and at most 1"
    )

    # MagCache over the 3 steps that run, against diffusers' hooks given WanPipeline's cache contexts (cond, uncond).
    (tmp_path / "ratios.json").write_text(json.dumps([1.0, 1.0, 1.0]))
    cache = ["--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_retention_ratio", 0]
    cache += ["--output_dir", tmp_path / "cached", "--executables", "off"]
    run_stage(stage2_transformer, ["--input_dir", out, *cache])
    section = read_config(tmp_path / "cached")["stage2"]
    assert section["step_cache"]["schedule"] == "FCC"
    hooked = v2v_pipeline()
    ran = computed_calls(hooked.transformer)
    hooked.transformer.enable_cache(mag_config([1.0] * 3, 3, retention_ratio=0))
    in_contexts(hooked.transformer)
    expected_cached = call("latent", pipe=hooked)
    assert ran == [True, True, False, False, False, False]  # cond, uncond per step
    cached = read_tensors(tmp_path / "cached", section)["latents"]
    assert relative_error(cached, expected_cached) <= TOLERANCE
    assert relative_error(cached, expected) > 100 * TOLERANCE  # the cache acts
    # The interval cache's window counts the steps that run: past the third is refused before weights load.
    window = ["--cache", "interval", "--cache_start_step", 1, "--cache_end_step", 4, "--cache_step_interval", 2]
    expect_user_error(capsys, stage2_transformer, ["--input_dir", out, *window], "do not fit 3 steps")


def test_a_folder_of_frames_reads_in_name_order_and_bad_videos_are_refused(tmp_path, video_file):
    frames, notes = read_video(str(video_file), "video")
    folder = tmp_path / "frames"
    folder.mkdir()
    for index, frame in enumerate(frames):
        frame.save(folder / f"{index:03d}.png")
    again, folder_notes = read_video(str(folder), "video")
    assert [np.asarray(a).tolist() for a in again] == [np.asarray(b).tolist() for b in frames]
    assert folder_notes == {"frames": 9, "size": [40, 56], "fps": None} and notes["frames"] == 9
    frames[0].resize((20, 20)).save(folder / "999.png")
    with pytest.raises(UserError, match="the frames differ in size"):
        read_video(str(folder), "video")
    (tmp_path / "not.mp4").write_text("no video here")
    with pytest.raises(UserError, match="is not a readable video"):
        read_video(str(tmp_path / "not.mp4"), "video")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="without frame images"):
        read_video(str(tmp_path / "empty"), "video")


@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("tiny-wan2.1", ["--strength", "0"], "--strength 0.0 must be above 0 and at most 1"),
        ("tiny-wan2.1", ["--strength", "0.1"], "runs none (int(steps x strength) is 0)"),
        ("tiny-wan2.1", ["--num_frames", "13"], "--num_frames 13: --video has 9 frames"),
        ("tiny-wan2.1", ["NO_VIDEO", "--strength", "0.5"], "--strength 0.5 acts only with stage 1's --video"),
        ("tiny-wan2.2", [], "takes no --video"),
        ("tiny-wan2.1-i2v", ["--image", "VIDEO"], "takes no --video"),
    ],
    ids=["strength-0", "strength-too-small", "more-frames", "strength-without-video", "two-experts", "i2v"],
)
def test_bad_video_requests_are_refused_before_loading(capsys, tmp_path, video_file, model, extra, message):
    argv = ["--model", model, "--prompt", PROMPT, "--output_dir", tmp_path / "out", "--num_inference_steps", "5"]
    video = [] if "NO_VIDEO" in extra else ["--video", str(video_file)]
    extra = [str(video_file) if item == "VIDEO" else item for item in extra if item != "NO_VIDEO"]
    expect_user_error(capsys, stage1_text_encoder, [*argv, *video, *extra], message)
    assert not (tmp_path / "out").exists()


def test_a_video_of_11_frames_gives_the_9_the_vae_encodes(tmp_path, capsys):
    """Wan's VAE encodes 4n+1 frames (11 frames and their first 9 give the same latents), so stage 1 takes 9."""
    path = tmp_path / "eleven.mp4"
    write_video(path, frames=11)
    argv = ["--model", "tiny-wan2.1", "--prompt", PROMPT, "--video", path, "--output_dir", tmp_path / "out"]
    run_stage(stage1_text_encoder, [*argv, "--height", 32, "--width", 48, "--dtype", "fp32"])
    config = read_config(tmp_path / "out", needs="stage1")
    assert config["num_frames"] == 9 and config["stage1"]["inputs"]["video"]["frames"] == 11
    assert config["strength"] == 0.8  # the pipeline's default, stored: every stage checks what runs
    assert "--video: 11 frames; the model takes 4n+1, so its first 9" in capsys.readouterr().out
