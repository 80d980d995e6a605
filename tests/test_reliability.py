"""Reliability through the real command line: bad stage files, preemption and resume, moved folders.

Every failure must exit with status 2 and one `error:` line naming the problem, and leave the
previous good files byte for byte as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import ROOT, expect_user_error, read_mp4, run_script, run_stage
from utils import CHECKPOINT_FILE, CONFIG_FILE, STAGE1_FILE, STAGE2_FILE, VIDEO_FILE, write_tensors

TINY = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--dtype", "fp32", "--num_inference_steps", "3"]


STAGES = {"stage1_text_encoder.py": stage1_text_encoder, "stage2_transformer.py": stage2_transformer}
STAGES["stage3_vae_decoder.py"] = stage3_vae_decoder


def run_ok(script, argv):
    """A stage in this process (its __main__ path: a user error exits 2, which fails the caller)."""
    run_stage(STAGES[script], argv)


def run_process_ok(script, argv):
    """A stage as its own process, where the test compares with another process's output bit for bit."""
    result = run_script(script, argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A complete, good stage folder (all three stages), built once through the CLI."""
    out = tmp_path_factory.mktemp("good")
    run_ok("stage1_text_encoder.py", [*TINY, "--output_dir", out])
    run_ok("stage2_transformer.py", ["--input_dir", out])
    run_ok("stage3_vae_decoder.py", ["--input_dir", out])
    return out


def snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def expect_cli_error(capsys, script, argv, message):
    """Exit status 2 and one `error:` line, in this process (test_user_errors runs the real command line)."""
    expect_user_error(capsys, STAGES[script], argv, message)


def truncate(folder):
    path = folder / STAGE1_FILE
    path.write_bytes(path.read_bytes()[:-100])
    return "stage2_transformer.py", f"{STAGE1_FILE} does not match the sha256"


def flip_a_byte(folder):
    path = folder / STAGE2_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return "stage3_vae_decoder.py", f"{STAGE2_FILE} does not match the sha256"


def latents_of_another_request(folder):
    other = folder.parent / f"{folder.name}-other"
    run_ok("stage1_text_encoder.py", [*TINY, "--output_dir", other, "--seed", "5"])
    run_ok("stage2_transformer.py", ["--input_dir", other])
    shutil.copy(other / STAGE2_FILE, folder / STAGE2_FILE)
    return "stage3_vae_decoder.py", f"{STAGE2_FILE} does not match the sha256"


def stage1_rerun_with_another_request(folder):
    """Stage 1 keeps the stage2 section; stage 3 must notice it no longer fits."""
    run_ok("stage1_text_encoder.py", [*TINY, "--output_dir", folder, "--num_inference_steps", "4"])
    return "stage3_vae_decoder.py", "the stage2 section is stale, stage 1 was rerun since (num_inference_steps changed)"


def other_model_family(folder):
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["model_family"] = "hunyuanvideo15"
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return "stage3_vae_decoder.py", "is a cogvideox model but the stage files are from hunyuanvideo15"


def out_of_order(folder):
    config = json.loads((folder / CONFIG_FILE).read_text())
    del config["stage2"]
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return "stage3_vae_decoder.py", "has no 'stage2' section (run the stage2 script first)"


def newer_format(folder):
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["format_version"] = 99
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return "stage2_transformer.py", "was written by a newer version of this tool (format_version 99"


def nan_embeddings(folder):
    """Well-formed but poisoned stage-1 file: stage 2 must refuse to write the result."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    embeds = load_file(str(folder / STAGE1_FILE))
    embeds["prompt_embeds"][0, 0, 0] = float("nan")
    config["stage1"].update(write_tensors(folder / STAGE1_FILE, embeds))
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return "stage2_transformer.py", "step 1 of 3 produced NaN or Inf latents; nothing was written"


BREAKAGES = [
    truncate,
    flip_a_byte,
    latents_of_another_request,
    stage1_rerun_with_another_request,
    other_model_family,
    out_of_order,
    newer_format,
    nan_embeddings,
]


@pytest.mark.slow
@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__)
def test_bad_inputs_fail_cleanly_and_keep_previous_outputs(good_run, tmp_path, breakage, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(good_run, folder)
    script, message = breakage(folder)
    before = snapshot(folder)
    expect_cli_error(capsys, script, ["--input_dir", folder], message)
    assert snapshot(folder) == before


def test_unwritable_output_folder_fails_before_work(good_run, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    expect_cli_error(
        capsys, "stage2_transformer.py", ["--input_dir", good_run, "--output_dir", blocker / "out"], "cannot create"
    )


def test_a_folder_takes_one_writer_at_a_time(good_run, tmp_path):
    """A folder another process writes is refused at once, naming that process; readers share a folder (two
    stage 2s from one stage-1 folder into two others), but no writer joins them; the lock file goes with the
    last holder. The other side here is this test process, through the stages' own lock."""
    from tpu_video.cli import folders

    folder = tmp_path / "copy"
    shutil.copytree(good_run, folder)
    folders.hold(folder, write=True)
    try:
        done = run_script("stage3_vae_decoder.py", ["--input_dir", folder])
        assert done.returncode == 2 and f"{folder} is in use: " in done.stderr, done.stderr[-800:]
        assert f"(process {os.getpid()}) writing it since" in done.stderr
    finally:
        folders.release()
    assert not (folder / folders.LOCK_FILE).exists()
    folders.hold(folder, write=False)  # a reader, as a stage 2 writing elsewhere is
    try:
        another_reader = (
            "from pathlib import Path; from tpu_video.cli import folders; folders.hold(Path(%r), write=False)"
        )
        shared = subprocess.run([sys.executable, "-c", another_reader % str(folder)], cwd=ROOT, capture_output=True)
        assert shared.returncode == 0, shared.stderr[-800:]
        rewrite = run_script("stage2_transformer.py", ["--input_dir", folder])
        assert rewrite.returncode == 2 and "reading it since" in rewrite.stderr, rewrite.stderr[-800:]
    finally:
        folders.release()
    assert snapshot(folder) == snapshot(good_run)


# Preemption and resume -----------------------------------------------------------------------------

# The interrupt lands after the first checkpoint (step 10): the 110 steps after it (~25 ms each here) leave the
# test seconds to send it while the run still goes.
LONG = ["--num_inference_steps", "120"]


@pytest.fixture(scope="module")
def long_request(tmp_path_factory):
    """A stage-1 folder for a 120-step run (tiny steps, so a run lasts a few seconds)."""
    out = tmp_path_factory.mktemp("long")
    run_ok("stage1_text_encoder.py", [*TINY, *LONG, "--output_dir", out])
    return out


@pytest.fixture(scope="module")
def uninterrupted(long_request, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run_process_ok("stage2_transformer.py", ["--input_dir", long_request, "--output_dir", out])
    return load_file(str(out / STAGE2_FILE))["latents"]


def start_and_interrupt(input_dir, out, sig):
    """Start stage 2 with checkpoints every 10 steps and send `sig` once the first checkpoint exists."""
    argv = [sys.executable, str(ROOT / "stage2_transformer.py"), "--input_dir", str(input_dir)]
    argv += ["--output_dir", str(out), "--checkpoint_every", "10"]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / CHECKPOINT_FILE).exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_resume_after_interruption_is_bit_identical(long_request, uninterrupted, tmp_path, sig):
    out = tmp_path / "out"
    returncode, stderr = start_and_interrupt(long_request, out, sig)
    assert returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143), stderr[-3000:]
    if sig == signal.SIGTERM:
        assert "stopped: SIGTERM after step" in stderr and "--resume" in stderr
    assert (out / CHECKPOINT_FILE).exists() and not (out / STAGE2_FILE).exists()

    result = run_process_ok("stage2_transformer.py", ["--input_dir", long_request, "--output_dir", out, "--resume"])
    assert "resuming after step" in result.stdout
    resumed = load_file(str(out / STAGE2_FILE))["latents"]
    assert torch.equal(resumed, uninterrupted)
    assert not (out / CHECKPOINT_FILE).exists()  # removed once the final latents are written
    assert json.loads((out / CONFIG_FILE).read_text())["stage2"]["resumed"] is True


def test_resume_needs_a_matching_checkpoint(good_run, tmp_path, capsys):
    expect_cli_error(
        capsys,
        "stage2_transformer.py",
        ["--input_dir", good_run, "--output_dir", tmp_path, "--resume"],
        "there is no checkpoint",
    )
    torch_state = {"latents": torch.zeros(1)}

    save_file(torch_state, str(tmp_path / CHECKPOINT_FILE), metadata={"next_step": "1", "fingerprint": "{}"})
    expect_cli_error(
        capsys,
        "stage2_transformer.py",
        ["--input_dir", good_run, "--output_dir", tmp_path, "--resume"],
        "belongs to a different request or stage-1 file",
    )


# Moving folders between hosts ----------------------------------------------------------------------


@pytest.mark.slow
def test_copied_folder_decodes_on_a_host_without_jax(good_run, tmp_path, jax_blocked):  # noqa: F811
    elsewhere = tmp_path / "other-host" / "stage_outputs"
    shutil.copytree(good_run, elsewhere)
    (elsewhere / VIDEO_FILE).unlink()
    config_text = (elsewhere / CONFIG_FILE).read_text()
    assert str(good_run) not in config_text and str(ROOT) not in config_text  # no host paths recorded
    result = run_script(
        "stage3_vae_decoder.py", ["--input_dir", elsewhere, "--backend", "torch"], extra_pythonpath=jax_blocked
    )
    assert result.returncode == 0, result.stderr[-3000:]
    meta, frames = read_mp4(elsewhere / VIDEO_FILE)
    config = json.loads((elsewhere / CONFIG_FILE).read_text())
    assert len(frames) == config["stage3"]["frames"] == config["num_frames"]
    assert tuple(meta["size"]) == (config["width"], config["height"])


def test_a_format_version_1_folder_still_decodes_identically(good_run, tmp_path):
    """Version 1 recorded `latents_scaled_by_vae_scaling_factor: true` where 2 records the normalisation;
    stage 3 reads both, and the decoded frames (the lossless preview) are the same."""
    old = tmp_path / "v1"
    shutil.copytree(good_run, old)
    config = json.loads((old / CONFIG_FILE).read_text())
    assert config["format_version"] == 2 and config["stage2"]["latents_normalization"]["method"] == "scaling_factor"
    config["format_version"] = 1
    del config["stage2"]["latents_normalization"]
    config["stage2"]["latents_scaled_by_vae_scaling_factor"] = True
    (old / CONFIG_FILE).write_text(json.dumps(config))
    run_ok("stage3_vae_decoder.py", ["--input_dir", old])
    preview = "output_video_preview.png"
    assert (old / preview).read_bytes() == (good_run / preview).read_bytes()
    assert json.loads((old / CONFIG_FILE).read_text())["format_version"] == 2  # stage 3 wrote it back as 2


def test_sigterm_outside_stage_2s_loop_stops_with_one_line_and_leaves_no_temporary(tmp_path, capsys):
    """SIGTERM while a stage writes a file (stage 3's mp4, here any atomic write): `stopped:`, exit 143, the
    temporary removed and no file at the final name."""
    from tpu_video.cli import run_cli
    from utils import atomic_write

    def write(tmp):
        tmp.write_bytes(b"half a video")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda: atomic_write(tmp_path / "output_video.mp4", write))
    assert stop.value.code == 143
    assert "stopped: terminated (SIGTERM); no partial file was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # restored


# A call that stays in C for tens of seconds and never returns to Python in between, as the TPU compiler does
# (CogVideoX-2b's stage 2 for v6e-8 took minutes), under the stages' conventions; "finished" if it ran out.
LONG_C_CALL = """
import hashlib, signal
from tpu_video.cli import run_cli, still_working
signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner may start it with Ctrl-C ignored
def main():
    with still_working("compiling x", every=600):
        print("started", flush=True)
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 100_000_000)
    print("finished", flush=True)
run_cli(main)
"""


@pytest.mark.parametrize(
    "sig, status, line", [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted (Ctrl-C)")]
)
def test_a_stop_during_a_long_compile_ends_the_process_with_its_line(sig, status, line):
    """SIGTERM or Ctrl-C while the main thread is inside one long C call (a compile): its Python handler would
    run only when the call returns, minutes later; still_working's thread ends the process with the stop's line
    and exit status instead, before the call is through."""
    process = subprocess.Popen(
        [sys.executable, "-c", LONG_C_CALL], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "started\n"
        time.sleep(0.5)  # well into the C call, which lasts tens of seconds
        process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == status, (out, err)
    assert "finished" not in out
    assert err.strip().splitlines() == [f"stopped: {line} while compiling x; no partial file was written"]
