"""The cuDNN fused-attention backend's call (`jax.nn.dot_product_attention` with padding as lengths),
run here with implementation=None (XLA on CPU), against the float64 reference, and the backend choice.

Tolerance: 1e-5 relative in fp32, as for Splash. On an NVIDIA GPU the same call runs cuDNN in bf16; the
bound held there is 1e-2 relative to float64 on the same bf16-rounded inputs (test_cudnn_on_a_gpu_vs_float64,
which runs only where JAX sees a GPU: `JAX_PLATFORMS=cuda,cpu pytest tests/test_fused_attention.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import sharding
import stage2_transformer
from helpers import (
    Sample,
    expect_user_error,
    hunyuan_inputs,
    reference_attention,
    relative_error,
    tiny_hunyuan_transformer,
    tiny_stage1,
)
from tpu_video.attention.cudnn import fused_attention
from tpu_video.attention.plan import fixed_plan, resolve_backend
from tpu_video.models import hunyuanvideo15
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime


def qkv(batch=2, heads=2, q_len=40, kv_len=56, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((batch, heads, length, head_dim)).astype(np.float32) for length in (q_len, kv_len, kv_len)
    )


def prefix(lengths, size):
    return np.arange(size)[None, :] < np.asarray(lengths)[:, None]


def allowed_pairs(key_valid, query_valid, q_len, kv_len):
    """The (B, 1, Sq, Skv) boolean mask the validity vectors (None: all valid) stand for."""
    allowed = np.ones((2, 1, q_len, kv_len), dtype=bool)
    if key_valid is not None:
        allowed &= key_valid[:, None, None, :]
    if query_valid is not None:
        allowed &= query_valid[:, None, :, None]
    return allowed


@pytest.mark.parametrize("kv_lengths, q_lengths", [(None, None), ([56, 20], None), ([33, 1], [40, 7])])
def test_lengths_vs_float64(kv_lengths, q_lengths):
    q, k, v = qkv()
    key_valid = None if kv_lengths is None else prefix(kv_lengths, 56)
    query_valid = None if q_lengths is None else prefix(q_lengths, 40)
    # Rows with nothing allowed: zeros.
    expected = reference_attention(q, k, v, allowed_pairs(key_valid, query_valid, 40, 56))
    got = fused_attention(q, k, v, key_valid, query_valid, implementation=None)
    assert relative_error(got, expected) <= 1e-5
    if q_lengths is not None:
        assert not np.asarray(got)[1, :, 7:].any()  # padded queries give zeros, as PyTorch's SDPA


def _gpus():
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.skipif(not _gpus(), reason="needs an NVIDIA GPU that JAX sees (JAX_PLATFORMS=cuda,cpu)")
@pytest.mark.parametrize("kv_lengths, q_lengths", [(None, None), ([1000, 300], None), ([777, 1], [512, 100])])
def test_cudnn_on_a_gpu_vs_float64(kv_lengths, q_lengths):
    """The real cuDNN kernel in bf16, with padding as lengths, against float64 softmax attention."""
    import jax
    import jax.numpy as jnp

    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(heads=4, q_len=512, kv_len=1024, head_dim=64))
    key_valid = None if kv_lengths is None else prefix(kv_lengths, 1024)
    query_valid = None if q_lengths is None else prefix(q_lengths, 512)
    allowed = allowed_pairs(key_valid, query_valid, 512, 1024)
    expected = reference_attention(*(np.asarray(x, dtype=np.float64) for x in (q, k, v)), allowed)
    gpu = _gpus()[0]
    got = jax.jit(fused_attention)(*(jax.device_put(x, gpu) for x in (q, k, v, key_valid, query_valid)))
    assert relative_error(np.asarray(got, dtype=np.float64), expected) <= 1e-2


def test_a_mask_that_is_not_a_prefix_is_refused():
    q, k, v = qkv()
    key_valid = prefix([56, 20], 56)
    key_valid[0, 3] = False
    with pytest.raises(ValueError, match="not such a prefix"):
        fused_attention(q, k, v, key_valid, implementation=None)


@pytest.mark.parametrize("mesh", [(1, 1, 1), (2, 1, 4)], ids=lambda m: "dp{}-sp{}-tp{}".format(*m))
def test_hunyuanvideo15_masks_are_prefixes_and_the_fused_call_matches_eager(mesh):
    """The family with masks: its joint per-key masks (valid tokens first after the reorder) and the
    refiner's mask (the tokenizer pads on the right) pass as lengths, and the jitted transformer with the
    cudnn backend's call (on XLA) equals the stock eager forward."""

    def right_padded():
        values = hunyuan_inputs()
        values["encoder_attention_mask"][-1] = torch.tensor([1] * 7 + [0] * 5)  # the shared inputs have a hole
        return values

    with torch.no_grad():
        expected = tiny_hunyuan_transformer()(**right_padded(), return_dict=False)[0]
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(*mesh)))
    transformer = hunyuanvideo15.transformer.make_jit_safe(tiny_hunyuan_transformer())
    compiled = runtime.compile(Sample(transformer), hunyuanvideo15.transformer_rules().nested("transformer."))
    with attention_backend(runtime.env, fixed_plan("cudnn"), runtime.mesh, fused_implementation=None):
        got = runtime.to_host(compiled(**runtime.to_device(right_padded())))
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize(
    "requested, dtype, platform, expected",
    [
        ("auto", torch.bfloat16, "tpu", "splash"),
        ("auto", torch.bfloat16, "gpu", "cudnn"),
        ("auto", torch.float16, "gpu", "cudnn"),
        ("auto", torch.float32, "gpu", "xla"),  # cuDNN takes no fp32: XLA, with the reason logged
        ("auto", torch.bfloat16, "cpu", "xla"),
        ("cudnn", torch.bfloat16, "gpu", "cudnn"),
        ("xla", torch.bfloat16, "gpu", "xla"),
    ],
)
def test_backend_choice(requested, dtype, platform, expected):
    backend, why = resolve_backend(requested, dtype, platform)
    assert backend == expected and why
    if expected == "xla" and platform == "gpu" and requested == "auto":
        assert "takes bf16/fp16" in why


@pytest.mark.parametrize(
    "dtype, platform, message",
    [(torch.float32, "gpu", "cudnn takes bf16 or fp16"), (torch.bfloat16, "cpu", "cudnn needs an NVIDIA GPU")],
)
def test_cudnn_refusals(dtype, platform, message):
    with pytest.raises(ValueError, match=message):
        resolve_backend("cudnn", dtype, platform)


def test_stage2_refuses_cudnn_off_a_gpu_before_loading(capsys, tmp_path, request):
    folder = tiny_stage1(tmp_path / "in")
    request.getfixturevalue("no_weights_loaded")  # after stage 1, which loads its encoders
    expect_user_error(capsys, stage2_transformer, ["--input_dir", folder, "--attention", "cudnn", "--dtype", "bf16"],
                      "--attention cudnn needs an NVIDIA GPU; JAX's devices here are cpu")  # fmt: skip


def test_the_gpu_benchmark_runs_its_cpu_smoke_configuration(tmp_path):
    """benchmarks/gpu_step.py cannot be measured here (no GPU); its code path runs on the CPU."""
    import json

    from helpers import ROOT, run_script

    argv = ["--models", "tiny-cogvideox", "--device", "cpu", "--attention", "xla", "--steps", "1", "--warmup", "1"]
    argv += ["--baselines", "eager", "--backends", "auto", "flash", "cudnn"]  # torch.compile: minutes of C++ here
    rows = {}
    for side in ("pytorch", "ours"):  # one profiler per process (CUPTI takes one subscriber on a GPU)
        result = run_script(
            str(ROOT / "benchmarks" / "gpu_step.py"), [*argv, "--profile", tmp_path / side, "--profile_side", side]
        )
        assert result.returncode == 0, result.stderr[-2000:]
        rows[side] = json.loads(result.stdout.strip().splitlines()[-1])
    row = rows["pytorch"]
    assert row["layers"] == 2 and row["flops_per_step"] > 0 and row["ours"]["median_step_seconds"] > 0
    kernels = row["pytorch"]["eager"]
    assert kernels["auto"]["relative_error_vs_eager"] == 0 and kernels["flash"]["correct"]
    assert "refused" in kernels["cudnn"]  # no cuDNN on a CPU
    assert row["best"]["eager"]["backend"] in ("auto", "flash") and row["ours_over_best"]["eager"] > 0
    assert row["ours"]["mfu"] is None  # no peak FLOP/s for a CPU
    assert "aten::" in Path(row["profiles"]["pytorch"]).read_text() and "ours" not in row["profiles"]
    profiles = rows["ours"]["profiles"]
    assert list(Path(profiles["ours"]).rglob("*.xplane.pb")) and "pytorch" not in profiles
    assert re.search(r"/host:CPU / .*: [0-9.]+ ms in all", Path(profiles["ours_table"]).read_text())
