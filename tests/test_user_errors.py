"""Invalid requests fail before heavy work with exit status 2 and one `error:` line naming the problem."""

import json

import pytest

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, run_script, run_stage
from utils import CONFIG_FILE, STAGE1_FILE

TINY = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--num_inference_steps", "1"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--height", "72"], "--height 72 must be a positive multiple of 16"),
        (["--width", "0"], "--width 0 must be a positive multiple of 16"),
        (["--num_frames", "10"], "--num_frames 10 must be 8n+1"),
        (["--num_inference_steps", "0"], "--num_inference_steps 0 must be at least 1"),
        (["--dtype", "int8"], "--dtype 'int8' is not one of bf16, fp16, fp32"),
        (["--model", "./no/such/folder"], "--model './no/such/folder': no such folder"),
        # A name that is no preset, folder or owner/name hub id is refused at once, never asked of the hub.
        (["--model", "tiny-cogvidex"], "--model 'tiny-cogvidex' is not a preset, a local folder or a hub id"),
        (["--model", "tiny-cogvidex"], "did you mean tiny-cogvideox, tiny-cogvideox1.0"),
        (["--backend", "torchax", "--device", "cuda"], "--device applies to --backend torch; --backend torchax"),
    ],
)
def test_stage1_rejects_bad_requests(capsys, tmp_path, flags, message):
    expect_user_error(capsys, stage1_text_encoder, [*TINY, "--output_dir", tmp_path, *flags], message)
    assert not (tmp_path / CONFIG_FILE).exists()


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("tiny-hunyuanvideo15", ["--num_frames", "6"], "--num_frames 6 must be 4n+1"),
        ("tiny-hunyuanvideo15", ["--height", "20"], "--height 20 must be a positive multiple of 8"),
        ("tiny-hunyuanvideo15", ["--flow_shift", "0"], "--flow_shift 0.0 must be positive"),
        ("tiny-cogvideox", ["--flow_shift", "3"], "--flow_shift applies to flow-matching models"),
        # CogVideoX 1.5's rotary grid: the tiny config's sample size is 8 x 12 latents (64 x 96 pixels)
        ("tiny-cogvideox", ["--height", "80"], "--height 80 is over 64, the most this model's rotary embeddings"),
        ("tiny-cogvideox", ["--width", "112"], "--width 112 is over 96, the most this model's rotary embeddings"),
    ],
)
def test_family_specific_request_errors(capsys, tmp_path, model, flags, message):
    argv = ["--model", model, "--prompt", "x", "--output_dir", tmp_path, *flags]
    expect_user_error(capsys, stage1_text_encoder, argv, message)


def test_a_hub_id_the_host_cannot_reach_fails_at_once(capsys, tmp_path, monkeypatch):
    """Not in the Hugging Face cache and the hub's name does not resolve (offline): one line, no retries."""
    import socket

    def unresolved(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    argv = ["--model", "someone/not-a-model", "--prompt", "x", "--output_dir", tmp_path / "out"]
    err = expect_user_error(capsys, stage1_text_encoder, argv, "huggingface.co cannot be reached from this host")
    assert "not in the Hugging Face cache" in err and not (tmp_path / "out").exists()


def test_stage1_rejects_a_folder_of_another_pipeline(capsys, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    expect_user_error(
        capsys, stage1_text_encoder, ["--model", other, "--prompt", "x"], "is a 'StableDiffusionPipeline' pipeline"
    )


def test_stage1_rejects_a_folder_without_model_index(capsys, tmp_path):
    expect_user_error(
        capsys, stage1_text_encoder, ["--model", tmp_path, "--prompt", "x"], "model_index.json is missing"
    )


def test_stage2_without_stage1_files(capsys, tmp_path):
    expect_user_error(capsys, stage2_transformer, ["--input_dir", tmp_path], "run stage1_text_encoder.py first")


@pytest.fixture
def stage1_dir(tmp_path):
    run_stage(stage1_text_encoder, [*TINY, "--output_dir", tmp_path, "--dtype", "fp32"])
    return tmp_path


def test_stage2_with_missing_embeddings_file(capsys, stage1_dir):
    (stage1_dir / STAGE1_FILE).unlink()
    expect_user_error(capsys, stage2_transformer, ["--input_dir", stage1_dir], f"{STAGE1_FILE} is missing")


def test_stage2_with_changed_embeddings_file(capsys, stage1_dir):
    path = stage1_dir / STAGE1_FILE
    path.write_bytes(path.read_bytes()[:-8])
    expect_user_error(capsys, stage2_transformer, ["--input_dir", stage1_dir], "does not match the sha256")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_frames", "8"], "--num_frames 8 must be 8n+1"),
        (["--height", "40"], "--height 40 must be a positive multiple of 16"),
        (["--model", "tiny-wan2.1"], "--model 'tiny-wan2.1' is a wan model but the stage files are from cogvideox"),
        (["--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
        (["--quantize", "int8", "--quantize_layers", "mlp"], "argument --quantize_layers: invalid choice: 'mlp'"),
        # Silently a plain run before (the section recorded layers "ffn" for weights never quantized).
        (["--quantize_layers", "ffn"], "--quantize_layers ffn acts only with --quantize (int8_weight, int8"),
    ],
)
def test_stage2_rejects_bad_overrides(capsys, stage1_dir, flags, message):
    expect_user_error(capsys, stage2_transformer, ["--input_dir", stage1_dir, *flags], message)


def test_stage3_before_stage2(capsys, stage1_dir):
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", stage1_dir], "has no 'stage2' section")


def test_stage3_rejects_bad_fps(capsys, stage1_dir):
    run_stage(stage2_transformer, ["--input_dir", stage1_dir])
    expect_user_error(
        capsys, stage3_vae_decoder, ["--input_dir", stage1_dir, "--fps", "0"], "--fps 0 must be from 1 to 1000"
    )


def test_error_exit_status_through_the_real_command_line(tmp_path):
    result = run_script("stage1_text_encoder.py", [*TINY, "--output_dir", tmp_path, "--num_frames", "13"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --num_frames 13 must be 8n+1")


def test_stage3_rejects_device_with_the_jax_backend(capsys, stage1_dir):
    argv = ["--input_dir", stage1_dir, "--backend", "torchax", "--device", "cuda"]
    expect_user_error(capsys, stage3_vae_decoder, argv, "--device applies to --backend torch")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--plan", ""], "argument --plan: give a TPU"),  # taken as no --plan, it ran the whole stage
        (["--plan", "v6e-8", "--plan_json", "."], "argument --plan_json: '.' is a folder"),
        (["--plan", "v6e-8", "--plan_json", "NOWHERE/plan.json"], "argument --plan_json: its folder"),
        (["--plan", "v6e-8", "--save_executables", "FILE"], "is a file, not a folder"),
    ],
)
def test_every_stage_checks_its_plan_flags_before_anything_compiles(capsys, tmp_path, flags, message):
    file = tmp_path / "file"
    file.write_text("not a folder")
    flags = [{"FILE": str(file), "NOWHERE/plan.json": str(tmp_path / "none" / "plan.json")}.get(f, f) for f in flags]
    folder = {stage1_text_encoder: "--output_dir", stage2_transformer: "--input_dir", stage3_vae_decoder: "--input_dir"}
    for stage, flag in folder.items():
        expect_user_error(capsys, stage, ["--model", "tiny-wan2.1", flag, tmp_path, *flags], message)


def test_flags_that_cannot_act_are_refused(capsys, tmp_path):
    """Each ran silently before, changing nothing: --resume under --plan, a --executables folder with --backend
    torch (which compiles no programs)."""
    argv = ["--model", "tiny-wan2.1", "--input_dir", tmp_path, "--plan", "v6e-8", "--resume"]
    expect_user_error(capsys, stage2_transformer, argv, "--resume continues a denoise from its checkpoint; --plan")
    store = ["--backend", "torch", "--executables", tmp_path / "store"]
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", tmp_path, *store], "--backend torch compiles none")
    argv = ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", tmp_path, *store]
    expect_user_error(capsys, stage1_text_encoder, argv, "--backend torch compiles none")


def test_a_long_quiet_call_says_it_is_still_working(capsys):
    """A compile (minutes on a TPU for a published model) logs a line every so often; a quick one none."""
    import time

    from tpu_video.cli import still_working

    with still_working("compiling x", every=0.02):
        time.sleep(0.2)
    assert "compiling x: still working (" in capsys.readouterr().out  # how many lines depends on the host's load
    with still_working("quick", every=10.0):
        pass
    assert "quick" not in capsys.readouterr().out


# What parsing a stage's flags must not import (issue 65: `--help` took 1.7-2.6 s, torch's import alone more
# than a second): the numeric and model libraries load only once the flags are read.
HEAVY_LIBRARIES = ("torch", "numpy", "jax", "jaxlib", "torchax", "diffusers", "transformers", "safetensors", "PIL")


def test_help_and_flag_errors_import_no_heavy_library(tmp_path):
    blocked = tmp_path / "blocked"
    for name in HEAVY_LIBRARIES:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: parsing must not need it')\n"
        )
    for script in ("stage1_text_encoder.py", "stage2_transformer.py", "stage3_vae_decoder.py"):
        result = run_script(script, ["--help"], extra_pythonpath=blocked)
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
        result = run_script(script, ["--no_such_flag"], extra_pythonpath=blocked)
        assert result.returncode == 2 and "unrecognized arguments: --no_such_flag" in result.stderr, result.stderr
    # The help still names every preset, family option and media input (read from the families' declarations).
    unwrapped = {"COLUMNS": "1000"}  # argparse wraps help at hyphens otherwise ("tiny-" / "ltx2.3")
    help_text = run_script(
        "stage1_text_encoder.py", ["--help"], env_overrides=unwrapped, extra_pythonpath=blocked
    ).stdout
    for words in (
        "tiny-wan2.1-vace",
        "tiny-ltx2.3",
        "tiny-wan2.2-animate",
        "--control_video",
        "--pose_video",
        "--sigmas",
        "--scheduler",
    ):
        assert words in help_text
    # A run past parsing does need them: the block is in effect.
    result = run_script("stage1_text_encoder.py", [*TINY, "--output_dir", tmp_path / "out"], extra_pythonpath=blocked)
    assert result.returncode != 0 and "is blocked: parsing must not need it" in result.stderr


def test_an_error_wrapping_a_library_message_of_several_lines_is_one_line(capsys):
    from tpu_video.cli import UserError, run_cli

    def main():
        raise UserError("--model 'x': the library said:\n  first line\n\n  second line")

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --model 'x': the library said: first line second line\n"
