"""The attention plan (tpu_video/attention/plan.py): built once per run from the flags, the platform and the model,
recorded as built, and refusing flags that could not act under the backend it resolved."""

from __future__ import annotations

import json

import pytest
import torch

import stage2_transformer
from helpers import expect_user_error, run_stage, tiny_stage1
from tpu_video.attention.plan import AttentionFlags, build_plan
from tpu_video.runtime.mesh import ModelFacts, default_mesh

SPLASH_ONLY = {
    "--block_q": ["--block_q", "256"],
    "--block_kv": ["--block_kv", "256"],
    "--block_kv_compute": ["--block_kv_compute", "256"],
    "--local_window": ["--local_window", "64"],
    "--k_smoothing": ["--k_smoothing"],
}


@pytest.fixture(scope="module")
def stage1_folder(tmp_path_factory):
    return tiny_stage1(tmp_path_factory.mktemp("stage1"), "--num_inference_steps", 1)


@pytest.mark.parametrize("backend", ["xla", "auto", "cudnn"])
@pytest.mark.parametrize("flag", list(SPLASH_ONLY))
def test_a_splash_only_flag_under_another_backend_is_an_error(capsys, stage1_folder, tmp_path, flag, backend):
    """On this CPU host auto resolves to xla, and cudnn cannot run at all: the error is still the flag's."""
    argv = ["--input_dir", stage1_folder, "--output_dir", tmp_path, "--attention", backend, *SPLASH_ONLY[flag]]
    line = expect_user_error(capsys, stage2_transformer, argv, f"{flag} ")
    assert "acts only on the Splash kernel" in line and "--attention splash" in line
    assert not list(tmp_path.iterdir())


def test_plan_refuses_a_splash_only_flag_under_xla(capsys, stage1_folder):
    argv = ["--input_dir", stage1_folder, "--plan", "v6e-8", "--attention", "xla", "--local_window", "64"]
    expect_user_error(capsys, stage2_transformer, argv, "--local_window 64 acts only on the Splash kernel")


def test_the_stage2_section_records_the_plan_that_ran(monkeypatch, stage1_folder, tmp_path):
    from tpu_video.runtime import sdpa

    ran = []
    install = sdpa.attention_backend
    monkeypatch.setattr(sdpa, "attention_backend", lambda env, plan, *a: ran.append(plan) or install(env, plan, *a))
    splash = ["--attention", "splash", "--local_window", "64", "--k_smoothing", "--block_q", "256"]
    run_stage(
        stage2_transformer, ["--input_dir", stage1_folder, "--output_dir", tmp_path, *splash, "--warmup_steps", 0]
    )
    (plan,) = ran
    section = json.loads((tmp_path / "generation_config.json").read_text())["stage2"]
    assert plan.backend == "splash" and plan.splash.local_window == 64 and plan.splash.k_smoothing
    assert plan.splash.block_q == 256 and plan.splash.interpret
    assert {key: section[key] for key in plan.record()} == json.loads(json.dumps(plan.record()))
    assert section["mesh"] == plan.mesh.shape.as_dict()


FACTS = ModelFacts(heads=8)


def gpu_plan(devices: int, attention="auto", dtype=torch.bfloat16, **axes):
    def choose_mesh(dp, sp, tp, sequence_split):
        return default_mesh(devices, dp, sp, tp, branches=2, model=FACTS, sequence_split=sequence_split)

    flags = AttentionFlags(attention=attention, **axes)
    tiles = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
    options = {"heads": FACTS.heads, "tile_defaults": tiles, "tile_cap": None, "choose_mesh": choose_mesh}
    return build_plan(flags, platform="gpu", dtype=dtype, **options)


def test_cudnn_keeps_the_sequence_whole_by_default():
    plan = gpu_plan(8, "cudnn")
    assert plan.backend == "cudnn" and plan.mesh.shape.sp == 1 and plan.sequence_parallel == "none"
    assert (plan.mesh.shape.dp, plan.mesh.shape.tp) == (2, 4)
    assert "does not run on a split sequence" in plan.mesh.why
    assert gpu_plan(8).backend == "cudnn" and gpu_plan(8).mesh.shape.sp == 1  # auto on a GPU in bf16


def test_cudnn_with_a_split_sequence_is_an_error_naming_a_mesh_that_works():
    with pytest.raises(
        ValueError, match=r"--sp 2: cuDNN .* a mesh that works: --dp 2 --sp 1 --tp 4, or --attention xla"
    ):
        gpu_plan(8, "cudnn", sp=2)
    plan = gpu_plan(8, sp=2)  # auto: the user's sp stands, so attention is XLA's (the reason says why)
    assert plan.backend == "xla" and plan.mesh.shape.sp == 2 and "splits the sequence" in plan.backend_why


def test_the_backend_is_never_auto_and_fp32_on_a_gpu_is_xla():
    plan = gpu_plan(8, dtype=torch.float32)
    assert plan.backend == "xla" and "bf16/fp16" in plan.backend_why and plan.splash is None


def test_a_local_window_acts_on_self_attention_only():
    """Inside a module marked as cross-attention (Wan's attn2) the window is not applied, also where the
    prompt happens to be as long as the video; outside it, it is."""
    from helpers import attention_plan, relative_error
    from tpu_video.attention.calls import mark_cross_attention
    from tpu_video.runtime.sdpa import attention_backend
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=generator) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    runtime, plain, cross = TorchaxRuntime(None), Attend(), Attend()
    mark_cross_attention(cross)
    mark_cross_attention(cross)  # marking twice is marking once
    with attention_backend(runtime.env, attention_plan("splash", local_window=8)), runtime.env:
        inputs = [runtime.to_device(t) for t in (q, k, v)]
        windowed, whole = (runtime.to_host(module(*inputs)) for module in (plain, cross))
    assert relative_error(whole, expected) <= 1e-5
    assert relative_error(windowed, expected) > 0.1


def test_wan_runs_splash_with_a_local_window(tmp_path):
    """Wan's text cross-attention used to fail the run after loading ("a local window needs self-attention")."""
    import stage1_text_encoder

    argv = ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", tmp_path, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, argv)
    splash = ["--attention", "splash", "--local_window", "16", "--num_inference_steps", 1, "--warmup_steps", 0]
    run_stage(stage2_transformer, ["--input_dir", tmp_path, *splash])
    section = json.loads((tmp_path / "generation_config.json").read_text())["stage2"]
    assert section["attention"] == "splash" and section["splash"]["local_window"] == 16
