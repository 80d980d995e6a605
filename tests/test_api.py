"""The Python API (tpu_video/api.py): the three stages in one process, keywords for flags, writing the same
files as the command lines (the same computation repeated: the latents bit for bit), and refusing with the
stages' UserError instead of exiting."""

from __future__ import annotations

import pytest
import torch

import stage1_text_encoder
import stage2_transformer
from helpers import read_mp4, run_stage
from tpu_video import api
from tpu_video.cli import UserError
from utils import read_config, read_tensors

REQUEST = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 2, "seed": 3, "dtype": "fp32"}


def test_three_stages_in_one_process_write_what_the_command_lines_write(tmp_path):
    folder = api.encode(
        model="tiny-wan2.1", prompt="a cat", negative_prompt="-blurry", output_dir=tmp_path / "api", **REQUEST
    )
    assert api.denoise(folder, attention="xla") == folder
    video = api.decode(folder, backend="torch", device="cpu", save_frames=True, preview_frames=0)
    assert video == folder / "output_video.mp4" and len(read_mp4(video)[1]) == 5
    assert not (folder / "output_video_preview.png").exists()  # preview_frames=0 went through as a flag

    shell = tmp_path / "shell"
    flags = [item for key, value in REQUEST.items() for item in (f"--{key}", value)]
    argv = ["--model", "tiny-wan2.1", "--prompt", "a cat", "--negative_prompt=-blurry", "--output_dir", shell, *flags]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", shell, "--attention", "xla"])
    latents = [read_tensors(path, read_config(path)["stage2"])["latents"] for path in (folder, shell)]
    assert torch.equal(*latents)


def test_what_a_stage_refuses_raises_instead_of_exiting(tmp_path):
    with pytest.raises(UserError, match="--num_frames 6 must be 4n\\+1"):
        api.encode(model="tiny-wan2.1", prompt="a cat", output_dir=tmp_path, num_frames=6)
    with pytest.raises(UserError, match="shoe_size: not a flag of this stage"):
        api.encode(model="tiny-wan2.1", prompt="a cat", output_dir=tmp_path, shoe_size=None)
    with pytest.raises(UserError, match="num_frame: not a flag"):  # no abbreviations, as argparse would take
        api.encode(model="tiny-wan2.1", prompt="a cat", output_dir=tmp_path, num_frame=9)
    with pytest.raises(UserError, match="run --plan from the command line"):
        api.denoise(tmp_path, plan="v6e-8")
    assert not any(tmp_path.iterdir())
