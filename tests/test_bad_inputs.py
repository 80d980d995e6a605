"""Bad input is refused cleanly: non-finite numbers anywhere (flags, hand-edited configs, ratio files),
argparse's own errors, non-finite output, Ctrl-C. Each case: exit status 2 (130 for Ctrl-C), exactly one
`error:` line naming the input, and the folder byte-identical afterwards. In this process, through each
stage's main(); tests/test_user_errors.py runs the real command line."""

from __future__ import annotations

import json
import shutil

import pytest

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, run_stage, tiny_stage1
from utils import CONFIG_FILE, INTERRUPTED_EXIT_STATUS, run_cli, strict_json, write_config

STAGE1 = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--num_inference_steps", "2"]


@pytest.fixture(scope="module")
def denoised(tmp_path_factory):
    """One tiny CogVideoX folder through stage 2, shared by the cases below (each works on a copy)."""
    folder = tiny_stage1(tmp_path_factory.mktemp("bad-inputs"), "--num_inference_steps", 2)
    run_stage(stage2_transformer, ["--input_dir", folder])
    return folder


def snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


NON_FINITE_FLAGS = [
    (stage1_text_encoder, ["--guidance_scale", "nan"], "argument --guidance_scale: 'nan' is not a finite number"),
    (stage1_text_encoder, ["--guidance_scale", "inf"], "argument --guidance_scale: 'inf' is not a finite number"),
    (stage1_text_encoder, ["--flow_shift", "nan"], "argument --flow_shift: 'nan' is not a finite number"),
    (stage1_text_encoder, ["--guidance_scale_2", "-inf"], "argument --guidance_scale_2: expected one argument"),
    (stage1_text_encoder, ["--guidance_scale=-inf"], "argument --guidance_scale: '-inf' is not a finite number"),
    (stage1_text_encoder, ["--height", "2.5"], "argument --height: invalid int value: '2.5'"),
    (stage1_text_encoder, ["--num_inference_steps", "1e30"], "argument --num_inference_steps: invalid int value"),
    (stage1_text_encoder, ["--seed", "nan"], "argument --seed: invalid int value: 'nan'"),
    (stage1_text_encoder, ["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
]
OUT_OF_RANGE = [
    (["--num_inference_steps", "1001"], "--num_inference_steps 1001 is more than the scheduler's 1000 training"),
    (["--seed", "-1"], "--seed -1 must be from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], f"--seed {2**64} must be from 0 to 2**64 - 1"),
    (["--fps", "0"], "--fps 0 must be from 1 to 1000"),
    (["--fps", str(10**23)], f"--fps {10**23} must be from 1 to 1000"),
]


@pytest.mark.parametrize("module, flags, message", NON_FINITE_FLAGS, ids=lambda v: str(v)[:40])
def test_stage1_flag_errors_are_one_error_line(capsys, tmp_path, module, flags, message):
    line = expect_user_error(capsys, module, [*STAGE1, "--output_dir", tmp_path, *flags], message)
    assert line.endswith("(see stage1_text_encoder.py --help)")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags, message", OUT_OF_RANGE, ids=lambda v: str(v)[:30])
def test_stage1_out_of_range_values_are_refused_before_loading(capsys, tmp_path, flags, message, no_weights_loaded):
    expect_user_error(capsys, stage1_text_encoder, [*STAGE1, "--output_dir", tmp_path, *flags], message)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache", "magcache", "--cache_threshold", "nan"], "argument --cache_threshold: 'nan' is not a finite"),
        (["--cache_retention_ratio", "inf"], "argument --cache_retention_ratio: 'inf' is not a finite number"),
        (["--peer_timeout", "nan"], "argument --peer_timeout: 'nan' is not a finite number"),
        (["--guidance_scale", "nan"], "argument --guidance_scale: 'nan' is not a finite number"),
        (["--plan", "v6e-8", "--guidance_scale", "inf"], "argument --guidance_scale: 'inf' is not a finite number"),
        (["--dp", "1.5"], "argument --dp: invalid int value: '1.5'"),
        (["--cache", "magcache", "--cache_threshold=-1"], "--cache_threshold -1.0 must be greater than 0"),
        (["--cache", "magcache", "--cache_max_skip_steps", "-1"], "--cache_max_skip_steps -1 must be at least 1"),
        (["--cache", "magcache", "--cache_retention_ratio", "5"], "--cache_retention_ratio 5.0 must be from 0 up to"),
        (["--peer_timeout", "-5"], "--peer_timeout -5.0 must be a positive number of seconds"),
        (["--seed", "-1"], "--seed -1 must be from 0 to 2**64 - 1"),
        (["--plan", "v6e:3x3"], "--plan: libtpu knows no TPU topology 'v6e:3x3'"),
        (
            ["--coordinator_address", "notahost", "--num_processes", "2", "--process_id", "0"],
            "--coordinator_address 'notahost' must be HOST:PORT",
        ),
        (["--num_inference_steps", "5000"], "--num_inference_steps 5000 is more than the scheduler's 1000"),
    ],
)
def test_stage2_flag_errors_leave_the_folder_alone(capsys, denoised, tmp_path, flags, message):
    folder = shutil.copytree(denoised, tmp_path / "copy")
    before = snapshot(folder)
    expect_user_error(capsys, stage2_transformer, ["--input_dir", folder, *flags], message)
    assert snapshot(folder) == before


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda config: config.update(guidance_scale=float("nan")), "guidance_scale is NaN or infinite"),
        (lambda config: config["stage1"].update(seconds=float("inf")), "stage1.seconds is NaN or infinite"),
    ],
    ids=["request", "section"],
)
def test_a_hand_edited_config_with_nan_is_refused_naming_the_key(capsys, denoised, tmp_path, edit, message):
    folder = shutil.copytree(denoised, tmp_path / "copy")
    config = json.loads((folder / CONFIG_FILE).read_text())
    edit(config)
    (folder / CONFIG_FILE).write_text(json.dumps(config))  # Python's json writes NaN/Infinity
    before = snapshot(folder)
    for stage in (stage2_transformer, stage3_vae_decoder):
        expect_user_error(capsys, stage, ["--input_dir", folder], message)
    assert snapshot(folder) == before


def test_a_hand_edited_prompt_is_refused_as_stale(capsys, denoised, tmp_path):
    """The embeddings come from the prompt stage 1 recorded; a config that asks for another is refused."""
    folder = shutil.copytree(denoised, tmp_path / "copy")
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["stage1"]["prompts"] == {"prompt": config["prompt"], "negative_prompt": config["negative_prompt"]}
    config["prompt"] = "a dog"
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    before = snapshot(folder)
    for stage in (stage2_transformer, stage3_vae_decoder):
        expect_user_error(capsys, stage, ["--input_dir", folder], "prompt differs from what stage 1 encoded")
    assert snapshot(folder) == before


def test_a_config_that_is_not_an_object_is_refused(capsys, denoised, tmp_path):
    folder = shutil.copytree(denoised, tmp_path / "copy")
    (folder / CONFIG_FILE).write_text("[1, 2]")
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", folder], "holds a JSON list, not an object")


def test_configs_are_written_as_strict_json(tmp_path):
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_config(tmp_path, {"guidance_scale": float("nan")})
    assert not any(tmp_path.iterdir())
    assert strict_json({"a": 1.5}) == '{"a": 1.5}'


@pytest.mark.parametrize("name", ["noext", "", "video.gif"])
def test_stage3_output_name_must_be_an_mp4(capsys, denoised, tmp_path, name):
    folder = shutil.copytree(denoised, tmp_path / "copy")
    before = snapshot(folder)
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", folder, "--output_name", name], "name it .mp4")
    assert snapshot(folder) == before


def test_a_ratio_file_with_nan_is_refused(capsys, denoised, tmp_path):
    ratios = tmp_path / "ratios.json"
    ratios.write_text('{"mag_ratios": [1.0, NaN]}')
    flags = ["--input_dir", denoised, "--output_dir", tmp_path / "out", "--cache", "magcache"]
    expect_user_error(capsys, stage2_transformer, [*flags, "--cache_mag_ratios", ratios], "mag_ratios[1] is NaN")


def test_stage3_writes_nothing_when_the_decode_is_not_finite(capsys, denoised, tmp_path):
    """A hand-edited scaling factor of 1e-30 multiplies the latents by 1e30: the fp32 VAE overflows."""
    folder = shutil.copytree(denoised, tmp_path / "copy")
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["stage2"]["latents_normalization"]["scaling_factor"] = 1e-30
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    before = snapshot(folder)
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", folder], "the decoded frames hold NaN or Inf")
    assert snapshot(folder) == before


def test_ctrl_c_is_one_line_and_status_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        run_cli(interrupted)
    assert exit_info.value.code == INTERRUPTED_EXIT_STATUS
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["stopped: interrupted (Ctrl-C); no partial file was written"]
