"""Stage 2 as several processes (JAX's distributed runtime, gloo collectives between CPU processes),
through the real CLI: 2 processes x 4 virtual CPU devices against one process with 8.

Tolerance 1e-5 relative (fp32) against the one-process run: the tp all-reduces between processes go
through gloo, which sums in another order than XLA:CPU inside one process (1.1e-6 seen for CogVideoX).
Runs of the same process layout are bit-identical (the resume test holds them to torch.equal).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, relative_error, run_stage
from tpu_video.cli import UserError
from tpu_video.runtime.distributed import launch_settings
from utils import CHECKPOINT_FILE, CONFIG_FILE, STAGE2_FILE

pytestmark = pytest.mark.slow  # several processes each, 10-60 s a test

TOLERANCE = 1e-5
STAGE2 = ["--attention", "splash", "--dp", "2", "--tp", "4"]  # CFG on dp, which here is the host axis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(folders, *flags) -> list[subprocess.Popen]:
    """Stage 2 as len(folders) processes of 4 CPU devices each, process i reading (and, for 0, writing)
    folders[i]: a copy of stage 1's folder per host."""
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    processes = []
    for index, folder in enumerate(folders):
        argv = [sys.executable, str(ROOT / "stage2_transformer.py"), "--input_dir", str(folder), *map(str, flags)]
        argv += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(len(folders))]
        argv += ["--process_id", str(index)]
        processes.append(
            subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return processes


def finish(processes, timeout=300) -> list[tuple[int, str, str]]:
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=timeout)
        results.append((process.returncode, stdout, stderr))
    return results


def host_copies(stage1, tmp_path, count=2):
    folders = [tmp_path / f"host{index}" for index in range(count)]
    for folder in folders:
        shutil.copytree(stage1, folder)
    return folders


def snapshot(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def stage1_of(tmp_path_factory):
    """Stage 1's folder for a model, made once per module."""
    import stage1_text_encoder

    made = {}

    def folder(model: str):
        if model not in made:
            made[model] = out = tmp_path_factory.mktemp(model)
            argv = ["--model", model, "--prompt", 'a sign that reads "OPEN"', "--dtype", "fp32"]
            run_stage(stage1_text_encoder, [*argv, "--num_inference_steps", 3, "--seed", 5, "--output_dir", out])
        return made[model]

    return folder


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-hunyuanvideo15"])
def test_two_processes_equal_one_process_and_only_process_0_writes(stage1_of, model, tmp_path):
    import stage2_transformer

    stage1 = stage1_of(model)
    single = tmp_path / "single"
    run_stage(stage2_transformer, ["--input_dir", stage1, "--output_dir", single, *STAGE2])  # 8 devices here
    expected = load_file(str(single / STAGE2_FILE))["latents"]

    folders = host_copies(stage1, tmp_path)
    before = snapshot(folders[1])
    (code0, out0, err0), (code1, out1, err1) = finish(start_processes(folders, *STAGE2))
    assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
    latents = load_file(str(folders[0] / STAGE2_FILE))["latents"]
    assert relative_error(latents, expected) <= TOLERANCE
    stage2 = json.loads((folders[0] / CONFIG_FILE).read_text())["stage2"]
    assert stage2["processes"] == 2 and stage2["mesh"] == {"dp": 2, "sp": 1, "tp": 4}
    assert snapshot(folders[1]) == before  # process 1 wrote nothing into its folder
    assert "2 processes" in out0 and not [line for line in out1.splitlines() if line.startswith("[ ")]  # one log
    assert "denoise" in err0 and "denoise" not in err1  # one progress bar


def test_a_corrupted_copy_on_one_host_stops_both_before_loading(stage1_of, tmp_path):
    """The files' digests are compared before any model is read: one family shows it for all."""
    folders = host_copies(stage1_of("tiny-cogvideox"), tmp_path)
    embeddings = folders[1] / "stage1_embeddings.safetensors"
    data = bytearray(embeddings.read_bytes())
    data[-1] ^= 0xFF
    embeddings.write_bytes(bytes(data))
    results = finish(start_processes(folders, *STAGE2))
    for code, stdout, stderr in results:
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "process 1:" in errors[0] and "sha256" in errors[0], stderr[-3000:]
        assert "placed" not in stdout  # no weights were loaded
    assert not (folders[0] / STAGE2_FILE).exists() and not (folders[0] / CHECKPOINT_FILE).exists()


# Preemption across processes --------------------------------------------------------------------

LONG = ["--num_inference_steps", "60", "--checkpoint_every", "10"]


@pytest.fixture(scope="module")
def long_request(tmp_path_factory):
    import stage1_text_encoder

    out = tmp_path_factory.mktemp("long")
    argv = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--dtype", "fp32", "--output_dir", out]
    run_stage(stage1_text_encoder, [*argv, "--num_inference_steps", 60])
    return out


def wait_for_checkpoint(processes, folder) -> None:
    deadline = time.monotonic() + 300
    while not (folder / CHECKPOINT_FILE).exists():
        assert all(process.poll() is None for process in processes), finish(processes)
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_on_one_host_stops_both_and_the_resume_is_bit_identical(long_request, tmp_path):
    uninterrupted = host_copies(long_request, tmp_path / "uninterrupted")
    assert all(code == 0 for code, _, _ in finish(start_processes(uninterrupted, *LONG)))
    expected = load_file(str(uninterrupted[0] / STAGE2_FILE))["latents"]

    folders = host_copies(long_request, tmp_path / "interrupted")
    processes = start_processes(folders, *LONG)
    wait_for_checkpoint(processes, folders[0])
    processes[1].send_signal(signal.SIGTERM)  # the host without the files is told to stop
    results = finish(processes)
    assert [code for code, _, _ in results] == [143, 143], [err[-2000:] for _, _, err in results]
    steps = {
        line.split("after step ")[1].split()[0]
        for _, _, err in results
        for line in err.splitlines()
        if "stopped:" in line
    }
    assert len(steps) == 1  # the same step in both
    assert (folders[0] / CHECKPOINT_FILE).exists() and not (folders[1] / CHECKPOINT_FILE).exists()
    assert not (folders[0] / STAGE2_FILE).exists()

    results = finish(start_processes(folders, *LONG, "--resume"))
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    assert f"resuming after step {steps.pop()}" in results[0][1]
    assert torch.equal(load_file(str(folders[0] / STAGE2_FILE))["latents"], expected)
    assert not (folders[0] / CHECKPOINT_FILE).exists()


def test_a_killed_process_makes_the_other_exit_with_an_error(long_request, tmp_path):
    folders = host_copies(long_request, tmp_path)
    processes = start_processes(folders, *LONG, "--peer_timeout", 3)
    wait_for_checkpoint(processes, folders[0])
    processes[1].kill()
    killed_at = time.monotonic()
    code, _, stderr = finish(processes[:1], timeout=60)[0]
    waited = time.monotonic() - killed_at
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    # Gloo sees the connection drop at once; the heartbeat names the process within --peer_timeout.
    assert code == 2 and len(errors) == 1 and "process 1 sent no heartbeat for 3 s" in errors[0], stderr[-3000:]
    assert waited < 30  # --peer_timeout 3 plus a few heartbeats, not JAX's minutes
    assert not (folders[0] / STAGE2_FILE).exists()


def test_sigterm_before_the_loop_still_ends_the_process():
    """JAX's preemption service would catch SIGTERM and carry on; Processes.start turns it off."""
    code = (
        "import os, signal, sys, time; from tpu_video.runtime.distributed import Processes; "
        f"Processes.start({{'coordinator_address': '127.0.0.1:{free_port()}', 'num_processes': 1, 'process_id': 0}}); "
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); sys.exit(0)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGTERM, result.stderr[-2000:]


# When stage 2 starts several processes, and its mesh across hosts ---------------------------------


@pytest.mark.parametrize(
    "flags, environ, expected",
    [
        ((None, None, None), {}, None),  # a single host: nothing changes
        (("10.0.0.2:1234", 2, 1), {}, {"coordinator_address": "10.0.0.2:1234", "num_processes": 2, "process_id": 1}),
        (
            (None, 4, 0),
            {"JAX_COORDINATOR_ADDRESS": "h:5"},
            {"coordinator_address": "h:5", "num_processes": 4, "process_id": 0},
        ),
        (("h:5", 1, 0), {}, None),
        ((None, None, None), {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, {}),  # a TPU slice of 4 hosts: JAX discovers
        ((None, None, None), {"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # a single-host TPU VM
    ],
)
def test_launch_settings(flags, environ, expected):
    assert launch_settings(*flags, environ=environ) == expected


@pytest.mark.parametrize(
    "flags, message",
    [(("h:5", 2, None), "missing --process_id"), (("h:5", 2, 2), "must be in 0..1")],
)
def test_incomplete_launch_flags_are_errors(flags, message):
    with pytest.raises(UserError, match=message):
        launch_settings(*flags, environ={})
