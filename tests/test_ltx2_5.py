"""LTX-2.5 (Gemma 4, the prompt modulation as a fixed table, a duration head) against diffusers' LTX2Pipeline and
LTX2ImageToVideoPipeline run eagerly on the tiny-ltx2.5 presets' components: the length the duration head picks
when stage 1 is given no --num_frames (after stage 1 on torch and on torchax), the image's H.264 round trip at
LTX-2.5's CRF 18, stage 2 on the default mesh and with Splash on a split mesh, stage 3's decode.

Tolerances as in tests/test_ltx2.py: fp32, 1e-5 relative (Frobenius) for the video and audio latents, the
frames and the waveform.
"""

from __future__ import annotations

import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import ltx2_reference as reference
from helpers import pipeline, relative_error, run_stage, write_image
from utils import read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS = "a robot dancing", "blurry", 7, 4


def test_the_duration_head_picks_the_length_and_the_run_matches_the_pipeline(tmp_path):
    """No --num_frames: stage 1 records the count LTX2Pipeline picks when called without num_frames (its
    duration head on the prompt's connector outputs), and the three stages match that call."""
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2.5", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--seed", SEED, "--num_inference_steps", STEPS, "--output_dir", out])
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off"])
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    assert config["stage1"]["num_frames_from"].startswith("the prompt")
    pipe = pipeline("tiny-ltx2.5")

    def call(output_type):
        return pipe(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            generator=torch.Generator("cpu").manual_seed(SEED),
            height=config["height"],
            width=config["width"],
            num_inference_steps=STEPS,
            frame_rate=float(config["fps"]),
            output_type=output_type,
        )

    expected = call("latent")
    temporal = pipe.vae_temporal_compression_ratio
    assert config["num_frames"] == (expected.frames.shape[2] - 1) * temporal + 1 != 9  # not the preset's default
    tensors = read_tensors(out, config["stage2"])
    assert relative_error(tensors["latents"], expected.frames) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], expected.audio) <= TOLERANCE
    decoded = call("np")
    saved = read_tensors(out, config["stage3"]["frames_file"])
    assert relative_error(saved["frames_float"], torch.from_numpy(decoded.frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], decoded.audio[0]) <= TOLERANCE


def test_image_to_video_at_crf_18_on_torchax_and_splash_matches_the_pipeline(tmp_path):
    """LTX2ImageToVideoPipeline with a Gemma 4 checkpoint re-encodes the image at CRF 18 (diffusers'
    resolve_default_image_crf), which stage 1 records as its default; Gemma 4 and the connectors on torchax, the
    duration head on their outputs (no --num_frames: the pipeline, called without one, picks the same count),
    stage 2 with Splash on sp 2 x tp 4."""
    from PIL import Image

    image = write_image(tmp_path / "first.png", 45, 61)
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2.5-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--image", image]
    run_stage(stage1_text_encoder, [*argv, "--backend", "torchax", "--output_dir", out])
    stage2 = ["--attention", "splash", "--sp", "2", "--tp", "4"]
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2])
    config = read_config(out, needs="stage2")
    assert config["image_crf"] == 18 and config["stage1"]["num_frames_from"].startswith("the prompt")
    tensors = read_tensors(out, config["stage2"])
    first = Image.open(image).convert("RGB")
    video, audio = reference("tiny-ltx2.5-i2v", config, "latent", image=first, num_frames=None)
    assert tensors["latents"].shape == video.shape and config["num_frames"] != 9  # not the preset's default
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE


def test_the_preset_has_ltx2_5s_switches():
    """The tiny preset has LTX-2.5's switches (so the cases above run them): no prompt AdaLN, a keyframe position
    embedding, no video feed-forward bias; and its text encoder is Gemma 4."""
    pipe = pipeline("tiny-ltx2.5")
    config = pipe.transformer.config
    assert not config.use_prompt_adaln_single and config.use_keyframes_abs_pos_embedding and not config.ff_bias
    assert type(pipe.text_encoder).__name__ == "Gemma4UnifiedForConditionalGeneration"
    assert pipe.duration_head is not None
