"""LTX-2's conditions (tpu_video/models/ltx2/conditions.py) against diffusers' LTX2ConditionPipeline run eagerly
on the tiny text-to-video preset's components: images and clips at latent frames (a clip replacing the first
frames, keyframe images and a keyframe clip appended as tokens of their own), with strengths below 1; and the
placement checks made before any weights load.

Tolerances as in tests/test_ltx2.py: fp32, 1e-5 relative (Frobenius) for the video and audio latents, the
frames and the waveform. The tiny VAE compresses time 4x, so latent frame k > 0 is pixel frame 4(k-1)+1.
"""

from __future__ import annotations

import functools

import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import decoded_frames, expect_user_error, pipeline, relative_error, run_stage, write_image, write_video
from helpers import ltx2_reference as reference
from utils import read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS, FRAMES = "a robot dancing", "blurry", 7, 4, 17  # 17 frames: 5 latent frames


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Odd-sized images (resized and centre-cropped by the pipeline; one-frame conditions go through H.264), a
    5-frame mp4 clip and a 5-frame folder of frames."""
    folder = tmp_path_factory.mktemp("ltx2-conditions")
    frames = folder / "frames"
    frames.mkdir()
    for number in range(5):
        write_image(frames / f"{number:02d}.png", 70, 90, seed=10 + number)
    write_video(folder / "clip.mp4", frames=5, height=48, width=80)
    return {
        "first": write_image(folder / "first.png", 45, 61),
        "last": write_image(folder / "last.png", 80, 50, seed=4),
        "clip": folder / "clip.mp4",
        "frames": frames,
    }


@functools.cache
def condition_pipeline():
    from diffusers import LTX2ConditionPipeline

    return LTX2ConditionPipeline.from_pipe(pipeline("tiny-ltx2"))


def frames_of(path):
    from PIL import Image

    if path.is_dir():
        return [Image.open(file).convert("RGB") for file in sorted(path.iterdir())]
    return decoded_frames(path) if path.suffix == ".mp4" else Image.open(path).convert("RGB")


# case: ([(media name, latent index, strength)], stage-1 flags, stage-2 flags)
CASES = {
    "clip-extended-two-keyframes": (
        [("clip", 0, 1.0), ("first", 3, 0.6), ("last", -1, 0.9)],
        [],
        [],
    ),
    "keyframe-clip-8-devices-splash": (
        [("first", 0, 0.8), ("frames", 2, 1.0)],
        ["--image_crf", "0"],
        ["--attention", "splash", "--sp", "2", "--tp", "4"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_conditions_match_the_condition_pipeline(tmp_path, capsys, media, case):
    """Stage 1's prepared and encoded conditions, stage 2's loop with the video's tokens held to them and the
    keyframe tokens appended, the latents without them; the first case decodes too."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    conditions, stage1_flags, stage2_flags = CASES[case]
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--num_frames", FRAMES, "--output_dir", out]
    argv += ["--condition", *(media[name] for name, _, _ in conditions)]
    argv += ["--condition_index", *(index for _, index, _ in conditions)]
    argv += ["--condition_strength", *(strength for _, _, strength in conditions), *stage1_flags]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2_flags])
    config = read_config(out, needs="stage2")
    assert config["stage1"]["task"] == "conditions"
    tensors = read_tensors(out, config["stage2"])
    crf = config["image_crf"]
    arguments = {
        "conditions": [
            LTX2VideoCondition(frames=frames_of(media[name]), index=index, strength=strength, crf=crf)
            for name, index, strength in conditions
        ]
    }
    video, audio = reference(condition_pipeline(), config, "latent", **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    if stage2_flags:
        return
    # A later pass of a conditioned video is refused before weights load (the pipeline's latents= path renoises
    # around the conditions, which stage 2 does not run).
    argv = ["--input_dir", out, "--start_latents", out, "--output_dir", tmp_path / "again"]
    expect_user_error(capsys, stage2_transformer, argv, "--start_latents: this video is conditioned")
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    saved = read_tensors(out, config["stage3"]["frames_file"])
    frames, waveform = reference(condition_pipeline(), config, "np", **arguments)
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE
