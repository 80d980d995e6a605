"""Stage folders written by an earlier version of this tool run through today's stages.

tests/data/stage1_2026-11-27/<preset>: stage-1 folders (fp32, with family options on the command line: Wan 2.2's
`--guidance_scale_2` and `--flow_shift`, LTX-2's `--modality_scale` and `--motion_speed`) written on 2026-11-27
by the code after the LTX-2 decode fix and before the code moved into the `tpu_video` package (commit 812e8b1).
Today's stage 1 with the same request writes the same request and the same embeddings (1e-6 relative: the same
computation, another CPU may order its sums differently), so stage 2 on the old folder runs what a fresh
folder runs; stage 2 (and for LTX-2, with its decode's normalisation mark, stage 3) accept the old folder.
"""

from __future__ import annotations

import shutil

import pytest

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import ROOT, relative_error, run_stage
from utils import Request, read_config, read_tensors

SAMPLES = ROOT / "tests" / "data" / "stage1_2026-11-27"
OPTION_FLAGS = {"tiny-wan2.2": ("guidance_scale_2", "flow_shift"), "tiny-ltx2": ("modality_scale", "motion_speed")}


@pytest.mark.parametrize("preset", ["tiny-cogvideox", "tiny-wan2.2", "tiny-ltx2"])
def test_a_stage1_folder_from_before_the_package_move_runs_as_a_fresh_one(tmp_path, preset):
    old = tmp_path / "old"
    shutil.copytree(SAMPLES / preset, old)
    config = read_config(old)
    argv = ["--model", preset, "--prompt", config["prompt"], "--negative_prompt", config["negative_prompt"]]
    argv += ["--seed", config["seed"], "--num_inference_steps", config["num_inference_steps"], "--dtype", "fp32"]
    for flag in OPTION_FLAGS.get(preset, ()):
        argv += [f"--{flag}", config[flag]]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path / "new"])
    fresh = read_config(tmp_path / "new")
    assert Request.from_config(fresh) == Request.from_config(config)
    old_tensors, new_tensors = read_tensors(old, config["stage1"]), read_tensors(tmp_path / "new", fresh["stage1"])
    assert old_tensors.keys() == new_tensors.keys()
    for name, tensor in old_tensors.items():
        assert relative_error(new_tensors[name].float(), tensor.float()) <= 1e-6, name

    run_stage(stage2_transformer, ["--input_dir", old, "--executables", "off"])
    stage2 = read_config(old, needs="stage2")["stage2"]
    assert read_tensors(old, stage2)["latents"].isfinite().all()
    if preset == "tiny-ltx2":
        assert stage2["latents_normalization"] == {"method": "none", "vae_statistics_applied": True}
        run_stage(stage3_vae_decoder, ["--input_dir", old, "--backend", "torch"])
        assert (old / "output_video.mp4").stat().st_size > 0
