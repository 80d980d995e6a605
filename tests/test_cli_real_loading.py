"""The real loading path through the stages' command lines: tiny components saved with save_pretrained,
three stages run in this process with `--model <folder>` (tests/test_user_errors.py and
tests/test_no_jax_stages.py run the scripts as processes), and the mp4 read back."""

import json

import numpy as np
import pytest

from helpers import read_mp4, run_stages
from tpu_video.models import cogvideox
from utils import CONFIG_FILE, VIDEO_FILE

FLAGS = ["--height", "48", "--width", "80", "--num_frames", "17", "--num_inference_steps", "2", "--fps", "6"]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-cogvideox-saved")
    cogvideox.presets.tiny_pipeline("1.5", seed=3).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_three_stages_from_a_saved_folder_make_the_requested_mp4(saved_model, tmp_path, capsys):
    out = tmp_path / "stage_outputs"
    steps = [
        ("stage1_text_encoder.py", ["--model", saved_model, "--prompt", "a red cat", "--output_dir", out, *FLAGS]),
        ("stage2_transformer.py", ["--input_dir", out]),
        ("stage3_vae_decoder.py", ["--input_dir", out]),
    ]
    run_stages(steps)
    assert "17 frames x 48 x 80 at 6 fps" in capsys.readouterr().out

    meta, frames = read_mp4(out / VIDEO_FILE)
    assert tuple(meta["size"]) == (80, 48) and meta["fps"] == 6
    assert len(frames) == 17 and all(frame.size == 48 * 80 * 3 for frame in frames)
    assert np.std(np.stack(frames)) > 1.0, "decoded video is flat"

    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["model_family"] == "cogvideox" and config["model_id"] == str(saved_model)
    assert config["stage2"]["tensors"]["latents"] == {"shape": [1, 4, 5, 6, 10], "dtype": "bfloat16"}
    assert config["stage3"]["frames"] == 17 and config["stage3"]["backend"] == "torch"
    assert all(key in config for key in ("stage1", "stage2", "stage3"))


@pytest.mark.slow
def test_hunyuanvideo15_from_a_saved_folder_through_the_cli(tmp_path):
    """The same path for HunyuanVideo-1.5: both text encoders and tokenizers, guider and VAE saved and
    loaded back by class name from model_index.json."""
    from tpu_video.models import hunyuanvideo15

    folder = tmp_path / "tiny-hunyuanvideo15-saved"
    hunyuanvideo15.presets.tiny_pipeline(seed=5).save_pretrained(folder)
    out = tmp_path / "stage_outputs"
    request = ["--height", "48", "--width", "64", "--num_frames", "9", "--num_inference_steps", "2", "--fps", "12"]
    steps = [
        (
            "stage1_text_encoder.py",
            ["--model", folder, "--prompt", 'a sign saying "hi"', "--output_dir", out, *request],
        ),
        ("stage2_transformer.py", ["--input_dir", out, "--flow_shift", "7"]),
        ("stage3_vae_decoder.py", ["--input_dir", out]),
    ]
    run_stages(steps)

    meta, frames = read_mp4(out / VIDEO_FILE)
    assert tuple(meta["size"]) == (64, 48) and meta["fps"] == 12
    assert len(frames) == 9 and np.std(np.stack(frames)) > 1.0
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["model_family"] == "hunyuanvideo15" and config["flow_shift"] == 7.0
    assert config["stage2"]["tensors"]["latents"] == {"shape": [1, 4, 3, 6, 8], "dtype": "bfloat16"}
