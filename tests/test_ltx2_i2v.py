"""LTX-2 image-to-video (tpu_video/models/ltx2/i2v.py) against diffusers' LTX2ImageToVideoPipeline run eagerly on the
tiny preset's components: stage 1's H.264 round trip and image latents, stage 2's held first frame, stage 3's
decode; and the image checks made before any weights load. Tolerances as in tests/test_ltx2.py: fp32, 1e-5
relative (Frobenius) for the video and audio latents, the frames and the waveform.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, relative_error, run_stage, write_image
from helpers import ltx2_reference as reference
from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.models.ltx2 import i2v as ltx2_i2v
from utils import read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS = "a robot dancing", "blurry", 7, 4


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """An odd-sized random image: the H.264 round trip crops it to even sides, the pipeline resizes it."""
    return write_image(tmp_path_factory.mktemp("ltx2-image") / "first.png", 45, 61)


@pytest.mark.parametrize(
    "crf, stage1_flags, stage2_flags",
    [(None, [], []), (0, ["--backend", "torchax"], ["--attention", "splash", "--sp", "2", "--tp", "4"])],
    ids=["crf33-8-devices-and-decode", "no-recompress-torchax-stage1-splash"],
)
def test_image_to_video_matches_the_pipeline(capsys, tmp_path, image_file, crf, stage1_flags, stage2_flags):
    """LTX2ImageToVideoPipeline: stage 1's H.264 round trip (the default CRF 33, through PyAV) or none, and
    the VAE latents of the image (on torch, or on torchax, whose placed VAE's statistics are read before
    placing); stage 2's first frame held at timestep zero and never stepped; stage 3's decode of the whole
    video."""
    from PIL import Image

    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2-i2v", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--image", image_file, "--output_dir", out]
    run_stage(stage1_text_encoder, [*argv, *stage1_flags, *([] if crf is None else ["--image_crf", crf])])
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2_flags])
    config = read_config(out, needs="stage2")
    assert config["image_crf"] == (33 if crf is None else crf) and config["stage1"]["task"] == "i2v"
    tensors = read_tensors(out, config["stage2"])
    image = Image.open(image_file).convert("RGB")
    arguments = {"image": image, "image_crf": crf}
    video, audio = reference("tiny-ltx2-i2v", config, "latent", **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    if crf is None:
        run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
        config = read_config(out, needs="stage3")
        saved = read_tensors(out, config["stage3"]["frames_file"])
        frames, waveform = reference("tiny-ltx2-i2v", config, "np", **arguments)
        assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
        assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE
        argv = ["--input_dir", out, "--start_latents", out, "--output_dir", tmp_path / "again"]
        expect_user_error(capsys, stage2_transformer, argv, "LTX-2 image-to-video denoises from noise only")


def test_without_pyav_stage1_stops_before_loading_and_names_the_extra(monkeypatch, capsys, tmp_path, image_file):
    """The re-encode's PyAV is checked before Gemma 3 loads (it used to be found missing after the text
    encode); --image_crf 0 needs none."""
    find_spec = ltx2_i2v.importlib.util.find_spec
    monkeypatch.setattr(
        ltx2_i2v.importlib.util, "find_spec", lambda name, *rest: None if name == "av" else find_spec(name, *rest)
    )
    with pytest.raises(UserError, match=r"needs PyAV \(pip install"):
        ltx2_i2v.recompress(None, 33)
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
