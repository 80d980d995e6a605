"""LTX-2 image-to-video (tpu_video/models/ltx2/i2v.py) against diffusers' LTX2ImageToVideoPipeline run eagerly on the
tiny preset's components: stage 1's H.264 round trip and image latents, stage 2's held first frame, stage 3's
decode; and the image checks made before any weights load. Tolerances as in tests/test_ltx2.py: fp32, 1e-5
relative (Frobenius) for the video and audio latents, the frames and the waveform.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import enhancer_calls, expect_user_error, pipeline, relative_error, run_stage, tiny_upsampler, write_image
from helpers import ltx2_reference as reference
from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.models.ltx2 import crf as ltx2_crf
from utils import read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS = "a robot dancing", "blurry", 7, 4


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """An odd-sized random image: the H.264 round trip crops it to even sides, the pipeline resizes it."""
    return write_image(tmp_path_factory.mktemp("ltx2-image") / "first.png", 45, 61)


SYSTEM_PROMPT = "Describe the video that starts from this image."
ENHANCED = {"enable_prompt_enhancement": True, "system_prompt": SYSTEM_PROMPT}


@pytest.mark.parametrize(
    "crf, stage1_flags, stage2_flags",
    [
        (None, [], []),
        (
            0,
            ["--backend", "torchax", "--enhance_prompt", "--system_prompt", SYSTEM_PROMPT],
            ["--attention", "splash", "--sp", "2", "--tp", "4"],
        ),
    ],
    ids=["crf33-8-devices-and-decode", "no-recompress-torchax-stage1-enhanced-prompt-splash"],
)
def test_image_to_video_matches_the_pipeline(monkeypatch, tmp_path, image_file, crf, stage1_flags, stage2_flags):
    """LTX2ImageToVideoPipeline: stage 1's H.264 round trip (the default CRF 33, through PyAV) or none, and
    the VAE latents of the image (on torch, or on torchax, whose placed VAE's statistics are read before
    placing); with torchax, the prompt enhancer too (the text encoder on the host, shown the image, with given
    instructions), as the pipeline's enable_prompt_enhancement; stage 2's first frame held at timestep zero and
    never stepped; stage 3's decode of the whole video."""
    from PIL import Image

    calls = enhancer_calls(monkeypatch, "LTX2ImageToVideoPipeline")
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--image", image_file, "--output_dir", out]
    run_stage(stage1_text_encoder, [*argv, *stage1_flags, *([] if crf is None else ["--image_crf", crf])])
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2_flags])
    config = read_config(out, needs="stage2")
    assert config["image_crf"] == (33 if crf is None else crf) and config["stage1"]["task"] == "i2v"
    tensors = read_tensors(out, config["stage2"])
    image = Image.open(image_file).convert("RGB")
    arguments = {"image": image, "image_crf": crf, **(ENHANCED if "--enhance_prompt" in stage1_flags else {})}
    video, audio = reference("tiny-ltx2-i2v", config, "latent", **arguments)
    if "--enhance_prompt" in stage1_flags:
        assert len(calls) == 2 and calls[0] == calls[1], "stage 1 and the pipeline enhance differently"
        assert calls[0]["image"] == np.asarray(image).tobytes() and calls[0]["seed"] == SEED
        assert config["stage1"]["enhanced_prompt"] == calls[0]["text"][0] != PROMPT
    else:
        assert not calls and "enhanced_prompt" not in config["stage1"]
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    if crf is None:
        run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
        config = read_config(out, needs="stage3")
        saved = read_tensors(out, config["stage3"]["frames_file"])
        frames, waveform = reference("tiny-ltx2-i2v", config, "np", **arguments)
        assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
        assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE


def test_the_two_stage_image_to_video_pipeline_matches_diffusers(tmp_path, image_file):
    """The two-stage pipeline from an image (no H.264 step), each pass against diffusers' own call: the distilled
    pass (LTX2ImageToVideoPipeline, sigmas=DISTILLED_SIGMA_VALUES, guidance off), the x2 upsampler
    (LTX2LatentUpsamplePipeline), then the refine at twice the size (the same pipeline with its scheduler rebuilt,
    `latents=` the upsampled, `audio_latents=` the first call's, `noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0]`,
    `image=` given again and unused: the first latent frame is the given one, never renoised nor stepped)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES, STAGE_2_DISTILLED_SIGMA_VALUES
    from PIL import Image

    first, up, second = tmp_path / "first", tmp_path / "up", tmp_path / "second"
    argv = ["--model", "tiny-ltx2-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--image", image_file, "--image_crf", 0, "--sigmas", "distilled", "--output_dir", first]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", first, "--executables", "off"])
    config = read_config(first, needs="stage2")
    off = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0}
    off |= {"modality_scale": 1.0, "audio_modality_scale": 1.0}
    image = Image.open(image_file).convert("RGB")
    pipe = pipeline("tiny-ltx2-i2v")
    common = {"image": image, "image_crf": 0, **off}
    video, audio = reference(pipe, config, "latent", sigmas=DISTILLED_SIGMA_VALUES, **common)
    tensors = read_tensors(first, config["stage2"])
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE

    upsampler = tiny_upsampler(tmp_path / "upsampler")
    step = ["--input_dir", first, "--upsample", "--latent_upsampler", tmp_path / "upsampler", "--output_dir", up]
    run_stage(stage2_transformer, step)
    larger = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)(
        latents=video, output_type="latent", return_dict=False
    )[0]
    assert relative_error(read_tensors(up, read_config(up, needs="stage2")["stage2"])["latents"], larger) <= TOLERANCE

    refine = ["--input_dir", first, "--start_latents", up, "--output_dir", second, "--executables", "off"]
    run_stage(stage2_transformer, [*refine, "--sigmas", "distilled_refine", "--seed", 11])
    refined = read_config(second, needs="stage2")
    height, width = 2 * config["height"], 2 * config["width"]
    assert (refined["height"], refined["width"]) == (height, width)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None
    )
    again = {**config, "num_inference_steps": 3, "seed": 11, "height": height, "width": width}
    noise_scale = STAGE_2_DISTILLED_SIGMA_VALUES[0]
    extra = {"sigmas": STAGE_2_DISTILLED_SIGMA_VALUES, "noise_scale": noise_scale, "audio_latents": audio}
    video_2, audio_2 = reference(pipe, again, "latent", latents=larger, **common, **extra)
    ours = read_tensors(second, refined["stage2"])
    assert relative_error(video_2, larger) > 1e-2  # the refine changed them
    assert relative_error(ours["latents"], video_2) <= TOLERANCE
    assert relative_error(ours["audio_latents"], audio_2) <= TOLERANCE


def test_without_pyav_stage1_stops_before_loading_and_names_the_extra(monkeypatch, capsys, tmp_path, image_file):
    """The re-encode's PyAV is checked before Gemma 3 loads (it used to be found missing after the text
    encode); --image_crf 0 needs none."""
    util = ltx2_crf.importlib.util
    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *rest: None if name == "av" else find_spec(name, *rest))
    with pytest.raises(UserError, match=r"needs PyAV \(pip install"):
        ltx2_crf.recompress(None, 33)
    argv = ["--model", "tiny-ltx2-i2v", "--prompt", PROMPT, "--image", image_file, "--output_dir", tmp_path]
    with monkeypatch.context() as patched:
        patched.setattr(models.ModelSource, "load", lambda *args, **kwargs: pytest.fail("weights loaded"))
        expect_user_error(capsys, stage1_text_encoder, argv, "--image_crf 33: re-encoding the image needs PyAV")
    source, family = models.resolve_model("tiny-ltx2-i2v")
    family.check_inputs(source, SimpleNamespace(option={"image_crf": 0}.get), {})  # no re-encode: nothing to check


def test_an_image_h264_cannot_encode_is_refused_before_loading(monkeypatch, capsys, tmp_path):
    """A side of 1 pixel: the H.264 helper crops it to 0 (an IndexError after the text encode, an empty folder
    left); now one error line before any weights load. --image_crf 0 takes such an image as it is."""
    thin = write_image(tmp_path / "thin.png", 1, 40)
    argv = ["--model", "tiny-ltx2-i2v", "--prompt", PROMPT, "--image", thin, "--output_dir", tmp_path / "out"]
    with monkeypatch.context() as patched:
        patched.setattr(models.ModelSource, "load", lambda *args, **kwargs: pytest.fail("weights loaded"))
        expect_user_error(capsys, stage1_text_encoder, argv, "--image is 40x1 pixels: H.264 (--image_crf 33) needs")
