"""The dp/sp/tp mesh, the weight rule tables, and sharded stage 2 against the single-device run.

Sharded-vs-unsharded tolerance: 1e-5 relative (fp32). Only the reduction order changes (partial sums
all-reduced across tp, attention split over sp), which moves fp32 results by ~1e-7 per step.
"""

from __future__ import annotations

import json

import pytest
import torch

import sharding
import stage2_transformer
from helpers import attention_plan, expect_user_error, relative_error, run_stage, tiny_stage1
from sharding import COLUMN, COLUMN_BIAS, REPLICATED, ROW, MeshShape, RuleTable
from tpu_video import models
from tpu_video.engine.denoise import DenoiseOptions, denoise
from tpu_video.engine.meta import attention_heads, meta_transformers, model_facts
from tpu_video.models import cogvideox, hunyuanvideo15, wan
from tpu_video.runtime import placement
from tpu_video.runtime.interface import Timer
from tpu_video.runtime.mesh import default_mesh
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from utils import Request, read_config, read_tensors

TOLERANCE = 1e-5
MESHES = [(1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2)]


def build_preset(name: str):
    return models.PRESETS[name].build()


# Rule tables ---------------------------------------------------------------------------------------


def real_cogvideox15_transformer():
    """CogVideoX1.5-5B's transformer at its published config, on the meta device (no memory, no download)."""
    from diffusers import CogVideoXTransformer3DModel

    with torch.device("meta"):
        return CogVideoXTransformer3DModel(**cogvideox.published.COGVIDEOX15_5B_TRANSFORMER)


def expected_cogvideox_spec(name: str, tp_mode: str):
    """The intended layout, written independently of the regex table."""
    if name.startswith("transformer_blocks.") and name.endswith((".norm1.linear.weight", ".norm2.linear.weight")):
        return ROW  # AdaLN modulation: input split
    if ".attn1.to_q." in name or ".attn1.to_k." in name or ".attn1.to_v." in name or ".ff.net.0.proj." in name:
        return COLUMN if name.endswith("weight") else COLUMN_BIAS
    if (".attn1.to_out.0." in name or ".ff.net.2." in name) and tp_mode == "megatron":
        return ROW if name.endswith("weight") else REPLICATED
    return REPLICATED


@pytest.mark.parametrize("tp_mode", sharding.TP_MODES)
@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-cogvideox1.0", "real-1.5-5b"])
def test_cogvideox_rule_table_matches_every_parameter_as_intended(model, tp_mode):
    if model == "real-1.5-5b":
        transformer = real_cogvideox15_transformer()
    else:
        transformer = build_preset(model).transformer
    names = [name for name, _ in transformer.named_parameters()]
    specs = cogvideox.transformer_rules(tp_mode).assign(names)
    assert specs == {name: expected_cogvideox_spec(name, tp_mode) for name in names}
    sharded = [name for name, spec in specs.items() if spec != REPLICATED]
    per_block = 12 if tp_mode == "megatron" else 10  # q/k/v, MLP in (+ out projections), 2 modulations
    assert len(sharded) == per_block * transformer.config.num_layers


def hunyuanvideo15_transformer(real: bool):
    """HunyuanVideo-1.5's transformer: the published 480p/720p t2v config on the meta device, or a tiny one."""
    from diffusers import HunyuanVideo15Transformer3DModel

    if real:
        with torch.device("meta"):
            return HunyuanVideo15Transformer3DModel(task_type="t2v")
    return hunyuanvideo15.presets.tiny_transformer()


def expected_hunyuan_spec(name: str, tp_mode: str):
    stream_in = (".to_q.", ".to_k.", ".to_v.", ".add_q_proj.", ".add_k_proj.", ".add_v_proj.", ".net.0.proj.")
    stream_out = (".to_out.0.", ".to_add_out.", ".net.2.")
    if name.startswith("transformer_blocks.") and name.endswith(
        (".norm1.linear.weight", ".norm1_context.linear.weight")
    ):
        return ROW  # AdaLN modulation: input split
    in_block = name.startswith("transformer_blocks.") or ".refiner_blocks." in name
    if in_block and any(part in name for part in stream_in):
        return COLUMN if name.endswith("weight") else COLUMN_BIAS
    if in_block and any(part in name for part in stream_out) and tp_mode == "megatron":
        return ROW if name.endswith("weight") else REPLICATED
    return REPLICATED


@pytest.mark.parametrize("tp_mode", sharding.TP_MODES)
@pytest.mark.parametrize("real", [False, True], ids=["tiny", "real-720p-t2v"])
def test_hunyuanvideo15_rule_table_matches_every_parameter_as_intended(real, tp_mode):
    transformer = hunyuanvideo15_transformer(real)
    names = [name for name, _ in transformer.named_parameters()]
    specs = hunyuanvideo15.transformer_rules(tp_mode).assign(names)
    assert specs == {name: expected_hunyuan_spec(name, tp_mode) for name in names}
    # q/k/v and MLP-in weights+biases of both streams, 2 modulations, plus the out weights in megatron mode
    per_block, per_refiner = (22, 10) if tp_mode == "megatron" else (18, 8)
    config = transformer.config
    expected = per_block * config.num_layers + per_refiner * config.num_refiner_layers
    assert sum(spec != REPLICATED for spec in specs.values()) == expected


def wan_transformers(model: str) -> list[torch.nn.Module]:
    """Every transformer of a published Wan pipeline (configs kept in code) on the meta device, or the tiny ones."""
    if model.startswith("tiny"):
        pipe = build_preset(model)
        return [module for module in (pipe.transformer, pipe.transformer_2) if module is not None]
    source, family = models.resolve_model(model, configs_only=True)
    return list(meta_transformers(family, source, torch.bfloat16, num_layers=40).values())


def expected_wan_spec(name: str, tp_mode: str):
    if name == "condition_embedder.time_proj.weight":
        return ROW  # the one modulation linear every block shares: input split
    if name.startswith("blocks.") and any(part in name for part in (".to_q.", ".to_k.", ".to_v.", ".net.0.proj.")):
        return COLUMN if name.endswith("weight") else COLUMN_BIAS
    if name.startswith("blocks.") and (".norm_q." in name or ".norm_k." in name):
        return COLUMN_BIAS  # RMS norm over all heads: split like q/k's columns
    if name.startswith("blocks.") and (".to_out.0." in name or ".net.2." in name) and tp_mode == "megatron":
        return ROW if name.endswith("weight") else REPLICATED
    return REPLICATED


@pytest.mark.parametrize("tp_mode", sharding.TP_MODES)
@pytest.mark.parametrize(
    "model", ["tiny-wan2.2", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"]
)
def test_wan_rule_table_matches_every_parameter_as_intended(model, tp_mode):
    transformers = wan_transformers(model)
    assert len(transformers) == (1 if "2.1" in model else 2)
    for transformer in transformers:
        names = [name for name, _ in transformer.named_parameters()]
        specs = wan.transformer_rules(tp_mode).assign(names)
        assert specs == {name: expected_wan_spec(name, tp_mode) for name in names}
        # q/k/v of both attentions, their q/k norms, MLP in (+ both out projections): per block; plus time_proj
        per_block = 21 if tp_mode == "megatron" else 18
        assert sum(spec != REPLICATED for spec in specs.values()) == per_block * transformer.config.num_layers + 1
        if not model.startswith("tiny"):
            assert transformer.config.num_attention_heads == 40 and transformer.config.num_layers == 40


def test_rule_table_rejects_unmatched_parameters_and_unused_rules():
    table = RuleTable("t", ((r"a\.weight", COLUMN), (r"gone\.weight", REPLICATED)))
    with pytest.raises(ValueError, match=r"without a rule \['b\.weight'\], rules that match nothing \['gone"):
        table.assign(["a.weight", "b.weight"])


def test_cogvideox_table_does_not_fit_another_model():
    vae = build_preset("tiny-cogvideox").vae
    with pytest.raises(ValueError, match="rules that match nothing"):
        cogvideox.transformer_rules().assign([name for name, _ in vae.named_parameters()])


def test_place_module_shards_each_weight_by_its_rule():
    transformer = build_preset("tiny-cogvideox").transformer
    runtime = TorchaxRuntime(placement.make_mesh(MeshShape(2, 1, 4)))
    reference = {name: param.detach().clone() for name, param in transformer.named_parameters()}
    runtime.compile(transformer, cogvideox.transformer_rules())
    params = dict(transformer.named_parameters())
    to_q, to_out = (
        params["transformer_blocks.0.attn1.to_q.weight"],
        params["transformer_blocks.0.attn1.to_out.0.weight"],
    )
    assert to_q.jax().addressable_shards[0].data.shape == (128 // 4, 128)
    assert to_out.jax().addressable_shards[0].data.shape == (128, 128 // 4)
    assert all(runtime.to_host(params[name]).equal(value) for name, value in reference.items())
    assert runtime.placements[-1]["sharded"] == 24 and runtime.placements[-1]["replicated"] == 40


# Sharded stage 2 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage1_outputs(tmp_path_factory):
    return tiny_stage1(tmp_path_factory.mktemp("stage1"), "--num_inference_steps", 3, "--seed", 3)


def denoise_on(stage1_dir, mesh_shape: MeshShape, attention: str = "xla"):
    config = read_config(stage1_dir, needs="stage1")
    request = Request.from_config(config)
    source, family = models.resolve_model_for_request(request)
    embeds = read_tensors(stage1_dir, config["stage1"])
    runtime = TorchaxRuntime(placement.make_mesh(mesh_shape))
    plan = attention_plan(attention, runtime.mesh, heads=attention_heads(source))
    with attention_backend(runtime.env, plan, runtime.mesh):
        tensors, _, _ = denoise(family, source, request, embeds, torch.float32, runtime, Timer(), DenoiseOptions())
    return tensors["latents"]


@pytest.fixture(scope="module")
def unsharded(stage1_outputs):
    return {attention: denoise_on(stage1_outputs, MeshShape(), attention) for attention in ("xla", "splash")}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "dp{}-sp{}-tp{}".format(*m))
def test_sharded_stage2_equals_single_device(stage1_outputs, unsharded, mesh):
    latents = denoise_on(stage1_outputs, MeshShape(*mesh))
    assert relative_error(latents, unsharded["xla"]) <= TOLERANCE


def test_the_default_mesh_of_six_devices_runs_and_equals_single_device(stage1_outputs, unsharded):
    """6 devices and 8 heads was an error (tp 3); the default is now dp 2 x sp 3 x tp 1 with ring attention."""
    source, family = models.resolve_model("tiny-cogvideox")
    choice = default_mesh(6, branches=2, model=model_facts(family, source, torch.float32, "megatron"))
    assert choice.shape == MeshShape(2, 3, 1) and "ring attention" in choice.why
    latents = denoise_on(stage1_outputs, choice.shape)
    assert relative_error(latents, unsharded["xla"]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 1, 4), (1, 2, 4), (2, 2, 2)], ids=lambda m: "dp{}-sp{}-tp{}".format(*m))
def test_sharded_splash_stage2_equals_single_device(stage1_outputs, unsharded, mesh):
    latents = denoise_on(stage1_outputs, MeshShape(*mesh), attention="splash")
    assert relative_error(latents, unsharded["splash"]) <= TOLERANCE
    assert relative_error(latents, unsharded["xla"]) <= TOLERANCE


@pytest.mark.parametrize(
    "mesh, sp_mode, attention",
    [
        ((1, 4, 2), "auto", "splash"),
        ((1, 8, 1), "auto", "splash"),
        ((1, 4, 2), "gather", "splash"),
        ((1, 4, 2), "ring", "splash"),
        ((1, 8, 1), "ring", "xla"),
    ],
)
def test_sequence_parallel_stage2_through_the_cli(stage1_outputs, unsharded, tmp_path, mesh, sp_mode, attention):
    """The real stage-2 CLI: Ulysses (auto) at sp=4 x tp=2 and sp=8, ring and the gather scheme equal the
    single-device run (CogVideoX's joint text+video attention, text padding masked), and the section says
    which scheme ran."""
    dp, sp, tp = mesh
    argv = ["--input_dir", stage1_outputs, "--output_dir", tmp_path, "--dp", dp, "--sp", sp, "--tp", tp]
    run_stage(stage2_transformer, [*argv, "--attention", attention, "--sp_mode", sp_mode])
    config = read_config(tmp_path)
    assert config["stage2"]["sequence_parallel"]["mode"] == ("ulysses" if sp_mode == "auto" else sp_mode)
    latents = read_tensors(tmp_path, config["stage2"])["latents"]
    assert relative_error(latents, unsharded[attention]) <= TOLERANCE


def test_stage2_records_mesh_and_placement(stage1_outputs, tmp_path):
    run_stage(stage2_transformer, ["--input_dir", stage1_outputs, "--output_dir", tmp_path, "--sp", 2])
    stage2 = json.loads((tmp_path / "generation_config.json").read_text())["stage2"]
    assert stage2["mesh"] == {"dp": 2, "sp": 2, "tp": 2}
    assert stage2["tp_mode"] == "megatron"
    # the two blocks' split weights stacked (--scan_blocks auto): 12 tensors, each holding both blocks'
    assert [placement["sharded"] for placement in stage2["placement"]] == [12]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", 3], "--dp 3 = 3 does not divide the 8 devices; a mesh that works: --dp 2 --sp 1 --tp 4"),
        (["--dp", 1, "--tp", 8, "--sp", 2], "= 16 devices"),
        (
            ["--attention", "splash", "--sp", 2, "--sp_mode", "ring", "--local_window", 8],
            "--sp_mode ring cannot run a local window",
        ),
    ],
)
def test_stage2_mesh_errors_come_before_loading(capsys, stage1_outputs, tmp_path, flags, message, no_weights_loaded):
    expect_user_error(
        capsys, stage2_transformer, ["--input_dir", stage1_outputs, "--output_dir", tmp_path, *flags], message
    )
    assert not (tmp_path / "stage2_latents.safetensors").exists()
