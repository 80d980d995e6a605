"""Stage 1 and stage 3 (--backend torch) run on a host where importing jax fails."""

import os
import subprocess
import sys

import pytest

from helpers import run_script, run_stage

# Library output the stages hide (tpu_video/workarounds/warning_filters.py), none of which may reach the user.
LIBRARY_NOISE = ("Loading weights", "Writing model shards", "requires torchvision", "Guiders are currently")


def assert_quiet(result) -> None:
    said = result.stdout + result.stderr
    assert not [noise for noise in LIBRARY_NOISE if noise in said], said[-3000:]


@pytest.mark.slow
def test_stage1_and_stage3_torch_backend_never_import_jax(jax_blocked, tmp_path):
    out = tmp_path / "out"
    flags = ["--height", "32", "--width", "48", "--num_frames", "9", "--num_inference_steps", "2"]
    probe = run_script("stage2_transformer.py", ["--help"], extra_pythonpath=jax_blocked)
    assert probe.returncode == 0  # --help works anywhere; the block itself is checked below

    stage1 = ["--model", "tiny-cogvideox", "--prompt", "a dog", "--output_dir", out, "--dtype", "fp32", *flags]
    result = run_script("stage1_text_encoder.py", stage1, extra_pythonpath=jax_blocked)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_quiet(result)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(jax_blocked), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", "import jax"], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "jax is blocked" in result.stderr, "the JAX block is not in effect"
    import stage2_transformer

    run_stage(stage2_transformer, ["--input_dir", out])  # stage 2 on a host with JAX (this one)

    result = run_script(
        "stage3_vae_decoder.py", ["--input_dir", out, "--backend", "torch"], extra_pythonpath=jax_blocked
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "9 frames x 32 x 48" in result.stdout

    # Asking for the JAX backend on such a host is one error line, not a traceback, before any model or
    # folder is read: the stage logged no line after its first ("loading torch and diffusers").
    for script, argv in (("stage1_text_encoder.py", stage1), ("stage3_vae_decoder.py", ["--input_dir", out])):
        result = run_script(script, [*argv, "--backend", "torchax"], extra_pythonpath=jax_blocked)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1].startswith("error: --backend torchax needs JAX and torchax")
        assert len(result.stdout.strip().splitlines()) == 1, result.stdout


@pytest.mark.slow
def test_ltx2_stage1_and_stage3_torch_backend_never_import_jax(jax_blocked, tmp_path):
    """LTX-2's Gemma 3, text connectors, video VAE, audio VAE and vocoder too, and the mp4's soundtrack."""
    out = tmp_path / "out"
    stage1 = ["--model", "tiny-ltx2", "--prompt", "a dog barking", "--output_dir", out, "--backend", "torch"]
    result = run_script("stage1_text_encoder.py", stage1, extra_pythonpath=jax_blocked)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_quiet(result)
    import stage2_transformer

    run_stage(stage2_transformer, ["--input_dir", out, "--num_inference_steps", "2"])
    result = run_script(
        "stage3_vae_decoder.py", ["--input_dir", out, "--backend", "torch"], extra_pythonpath=jax_blocked
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2-channel AAC soundtrack" in result.stdout
