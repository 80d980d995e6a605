"""Shared test helpers: running a stage in-process or as a real subprocess, and comparing tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _float64(values) -> torch.Tensor:
    if torch.is_tensor(values):
        return values.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.array(values, dtype=np.float64))


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64."""
    actual, expected = _float64(actual), _float64(expected)
    return ((actual - expected).norm() / expected.norm()).item()


def reference_attention(query, key, value, allowed=None, *, bias=None, scale=None) -> np.ndarray:
    """Softmax attention in float64, the one reference every attention test compares against.

    Inputs (B, H, S, D). `allowed` is a boolean mask and `bias` an additive one, each broadcastable to
    (B, H, Sq, Skv). Rows with no allowed key give zeros, as PyTorch's SDPA does."""
    query, key, value = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    scale = 1 / np.sqrt(query.shape[-1]) if scale is None else scale
    scores = np.einsum("bhqd,bhkd->bhqk", query, key) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float64)
    if allowed is not None:
        scores = np.where(np.asarray(allowed), scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0))
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bhkd->bhqd", weights, value)


def run_stage(module, argv: list[str]) -> None:
    """Run a stage's main() in this process exactly as its `__main__` block does."""
    from utils import run_cli

    run_cli(lambda: module.main([str(arg) for arg in argv]))


def expect_user_error(capsys, module, argv: list[str], message: str) -> str:
    """Assert the stage exits with status 2 and one `error:` line containing `message`."""
    with pytest.raises(SystemExit) as exit_info:
        run_stage(module, argv)
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1, err_lines
    assert message in err_lines[0], err_lines[0]
    return err_lines[0]


def run_script(
    script: str,
    argv: list[str],
    extra_pythonpath: Path | None = None,
    env_overrides: dict[str, str] | None = None,
    **kwargs,
):
    """Run a stage script as a real subprocess (the user's command line)."""
    env = {**os.environ, **(env_overrides or {})}
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / script), *[str(arg) for arg in argv]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        **kwargs,
    )


def read_mp4(path):
    """(metadata, frames as flat uint8 arrays) decoded back from an mp4 file with ffmpeg."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    frames = [np.frombuffer(frame, dtype=np.uint8) for frame in reader]
    return meta, frames


def tiny_stage1(out: Path, *flags) -> Path:
    """Stage 1 in this process on the tiny CogVideoX preset (fp32), into `out`; returns `out`."""
    import stage1_text_encoder

    argv = ["--model", "tiny-cogvideox", "--prompt", "a red cat", "--output_dir", out, "--dtype", "fp32", *flags]
    run_stage(stage1_text_encoder, argv)
    return out
