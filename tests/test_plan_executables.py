"""`--plan TARGET --save_executables DIR`: the plan compiles the run's own programs (tpu_video/runtime/programs.py) over
abstract weights and saves them keyed as the run on that target keys them.

A TPU cannot run here, so the key's equality is shown on the devices that can: the plan is pointed at this
host's 8 CPU devices, and the run's store and the plan's must hold the same keys, and a run must load the
plan's programs and give the latents the run that compiled its own gave. The TPU path itself is checked as
far as this host goes: libtpu's programs are serialized and keyed for the topology's devices.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import PreTrainedModel

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, run_stage, write_image
from sharding import MeshShape
from tpu_video import models
from tpu_video.cli import parse_dtype
from tpu_video.engine.meta import meta_pretrained
from tpu_video.planning import encoders, flags, plan, tpus
from tpu_video.runtime import executables, placement, program_key
from tpu_video.runtime.executables import SUFFIX, ExecutableStore
from tpu_video.stages import stage2_attention
from tpu_video.stages.feature_flags import cache_kind


def keys(store) -> list[str]:
    return sorted(path.name for path in store.glob(f"*{SUFFIX}"))


def latents(folder) -> np.ndarray:
    return load_file(folder / "stage2_latents.safetensors")["latents"]


def plan_on_this_host(monkeypatch, folder, store, argv: list[str]) -> dict:
    """stage2_run.plan_main, as `--plan v6e-8 --save_executables store` builds it, but compiled for
    this host's devices (with the attention plan a run here takes) instead of the TPU topology's."""
    monkeypatch.setattr(plan, "topology_mesh", lambda target, shape: placement.make_mesh(shape))
    args = stage2_transformer.parse_args(["--input_dir", str(folder), *argv])
    request, source, family, embeddings = flags.request_to_plan(folder, None, {}, None)
    dtype = parse_dtype(request.dtype)
    run_model = (family, source, request, dtype)
    attention = stage2_attention.attention_plan(args, run_model, "cpu", jax.device_count())
    cache = cache_kind(args)
    target = tpus.parse_target("v6e-8")  # names the report; the devices are this host's
    saving = ExecutableStore("folder", store)
    plan.plan_stage2(family, source, request, embeddings, dtype, target, attention, cache, 1, args.scan_blocks, saving)
    return saving.counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, argv",
    [
        ("tiny-wan2.1", []),  # blocks under one scan (auto)
        # text masks (checks inside); MagCache's full and cached steps; unrolled
        ("tiny-hunyuanvideo15", ["--cache", "magcache", "--cache_mag_ratios", "RATIOS", "--scan_blocks", "off"]),
    ],
)
def test_a_run_keys_its_programs_as_the_plan_saved_them_and_loads_them(tmp_path, monkeypatch, model, argv):
    out, run_store, plan_store = tmp_path / "out", tmp_path / "run", tmp_path / "plan"
    (tmp_path / "ratios.json").write_text(json.dumps([1.0] * 8))  # every step after the first can be cached
    argv = [str(tmp_path / "ratios.json") if flag == "RATIOS" else flag for flag in argv]
    run_stage(stage1_text_encoder, ["--model", model, "--prompt", "a cat", "--output_dir", out])
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", run_store, *argv])
    compiled = latents(out)
    counts = plan_on_this_host(monkeypatch, out, plan_store, argv)
    assert counts["saved"] == len(keys(run_store)) >= 1 and counts["unsaveable"] == 0
    assert keys(plan_store) == keys(run_store)

    run_stage(stage2_transformer, ["--input_dir", out, "--executables", plan_store, *argv])
    record = json.loads((out / "generation_config.json").read_text())["stage2"]
    assert record["executables"]["hits"] == counts["saved"] and record["executables"]["misses"] == 0
    assert record["seconds"]["compile"] == 0
    assert np.array_equal(latents(out), compiled)


@pytest.mark.slow
def test_a_stage3_run_keys_its_frame_programs_as_the_plan_saved_them_and_loads_them(tmp_path, monkeypatch):
    """Stage 3's frame programs (tiny Wan 2.1's first and steady ones): the plan pointed at this host's devices
    saves the keys a `--backend torchax` run computes, and a run given them loads every one and writes the
    frames the run that compiled its own wrote."""
    out, run_store, plan_store = tmp_path / "out", tmp_path / "run", tmp_path / "plan"
    run_stage(stage1_text_encoder, ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", out])
    run_stage(stage2_transformer, ["--input_dir", out])
    decode = ["--input_dir", out, "--backend", "torchax", "--save_frames"]
    run_stage(stage3_vae_decoder, [*decode, "--executables", run_store])
    frames_file = out / json.loads((out / "generation_config.json").read_text())["stage3"]["frames_file"]["file"]
    frames = load_file(frames_file)["frames_float"]
    monkeypatch.setattr(plan, "topology_mesh", lambda target, shape: placement.make_mesh(shape))
    argv = ["--input_dir", out, "--plan", "v6e-8", "--save_executables", plan_store, "--plan_json", tmp_path / "p"]
    run_stage(stage3_vae_decoder, argv)  # the plan's own path, compiled for this host's 8 CPU devices
    assert json.loads((tmp_path / "p").read_text())["executables"]["saved"] == len(keys(run_store)) == 2
    assert keys(plan_store) == keys(run_store)

    run_stage(stage3_vae_decoder, [*decode, "--executables", plan_store])
    record = json.loads((out / "generation_config.json").read_text())["stage3"]
    assert record["executables"]["hits"] == 2 and record["executables"]["misses"] == 0
    assert np.array_equal(load_file(frames_file)["frames_float"], frames)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-wan2.1-i2v", "tiny-hunyuanvideo15-i2v", "tiny-ltx2"])
def test_a_stage1_run_keys_its_encoder_programs_as_the_plan_saved_them_and_loads_them(tmp_path, monkeypatch, model):
    """Stage 1's device programs (UMT5, CLIP and the condition video's VAE encode in chunk programs, the cache
    each returns taken back by the next as laid out; or Qwen2.5-VL, ByT5 on the quoted text, SigLIP and the VAE
    encode of the image; or Gemma 3 and LTX-2's text connectors): the plan pointed at this host's devices saves the keys
    a `--backend torchax` run computes, and a run given them loads every one and writes the embeddings the run
    that compiled its own wrote."""
    run_store, plan_store, report_path = tmp_path / "run", tmp_path / "plan", tmp_path / "plan.json"
    image = ["--image", write_image(tmp_path / "image.png", 32, 48)] if "i2v" in model else []
    argv = ["--model", model, "--prompt", 'a sign that reads "OPEN"', *image]
    torchax = [*argv, "--backend", "torchax", "--executables"]
    run_stage(stage1_text_encoder, [*torchax, run_store, "--output_dir", tmp_path / "one"])
    monkeypatch.setattr(encoders, "topology_mesh", lambda target, shape: placement.make_mesh(shape))
    planned = ["--plan", "v6e-8", "--save_executables", plan_store, "--plan_json", report_path]
    run_stage(stage1_text_encoder, [*argv, *planned, "--output_dir", tmp_path / "unused"])
    report = json.loads(report_path.read_text())
    assert report["stage"] == 1 and report["fits"] and not (tmp_path / "unused").exists()
    programs = {"tiny-wan2.1-i2v": 4, "tiny-hunyuanvideo15-i2v": 4, "tiny-ltx2": 2}  # Wan: 5 frames, 2 chunks
    assert report["executables"]["saved"] == len(keys(run_store)) == programs[model]
    assert keys(plan_store) == keys(run_store)

    run_stage(stage1_text_encoder, [*torchax, plan_store, "--output_dir", tmp_path / "two"])
    record = json.loads((tmp_path / "two" / "generation_config.json").read_text())["stage1"]
    assert record["executables"]["hits"] == report["executables"]["saved"] and record["executables"]["misses"] == 0
    first, second = (load_file(tmp_path / run / "stage1_embeddings.safetensors") for run in ("one", "two"))
    assert first.keys() == second.keys() and all(np.array_equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("model", ["tiny-wan2.1-i2v", "tiny-cogvideox", "tiny-hunyuanvideo15-i2v", "tiny-ltx2"])
def test_the_plans_meta_encoders_are_the_encoders_from_pretrained_loads(model):
    """Stage 1's plan builds each transformers model from its config on the meta device (a published pipeline's
    configs kept in code have no weight files): the same tensors, shapes and dtypes as `from_pretrained` loads,
    in bf16 (T5's fp32 `wo` kept) and fp32."""
    source, _ = models.resolve_model(model)
    library_models = [name for name, entry in source.index.items() if isinstance(entry, list) and entry[0]]
    built_here = [name for name in library_models if issubclass(source.component_class(name), PreTrainedModel)]
    assert built_here
    for name, dtype in itertools.product(built_here, (torch.bfloat16, torch.float32)):
        loaded = source.component_class(name).from_pretrained(source.location, subfolder=name, dtype=dtype)
        built = meta_pretrained(source, name, dtype)
        described = [
            {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in module.state_dict(keep_vars=True).items()}
            for module in (loaded, built)
        ]
        assert described[0] == described[1] and not built.training
        assert all(tensor.is_meta for tensor in built.state_dict().values())


@pytest.mark.slow
def test_a_tpu_plan_saves_programs_keyed_for_the_topology(tmp_path):
    """libtpu's executables serialize; their key names the TPU topology's devices, not this host's."""
    store = tmp_path / "store"
    report_path = tmp_path / "plan.json"
    argv = ["--plan", "v5e-8", "--model", "tiny-wan2.1", "--input_dir", tmp_path / "none"]
    run_stage(stage2_transformer, [*argv, "--save_executables", store, "--plan_json", report_path])  # fits: no exit
    report = json.loads(report_path.read_text())
    assert report["executables"]["saved"] == len(keys(store)) == 1
    summary = json.loads(next(store.glob("*.json")).read_text())
    assert summary["name"] == "tpu_video.models.wan.transformer.GuidedTransformer.forward"
    devices = tpus.topology_devices(tpus.parse_target("v5e-8"))
    mesh = placement.make_mesh(MeshShape(**report["mesh"]), devices)
    expected = program_key.environment_parts(mesh, process=0)["devices"]
    assert expected["platform"] == "tpu" and expected["count"] == 8
    assert summary["parts"]["devices"] == program_key.digest(expected)

    stage1 = tmp_path / "stage1"  # stage 1's text encoder, by the TPU compiler, for all 8 devices on tp
    argv = ["--plan", "v5e-8", "--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", tmp_path / "unused"]
    run_stage(stage1_text_encoder, [*argv, "--save_executables", stage1, "--plan_json", report_path])
    report = json.loads(report_path.read_text())
    assert report["fits"] and report["mesh"] == {"dp": 1, "sp": 1, "tp": 8} and len(keys(stage1)) == 1
    assert report["collectives"]["UMT5EncoderModel ([1, 512], [1, 512])"]["all-reduce"]["count"] >= 1


def test_a_plan_from_the_model_alone_reads_no_folder():
    """`--plan T --model M` without --input_dir plans from the model, whatever ./stage_outputs holds."""
    assert flags.plan_folder(None, "tiny-wan2.2") is None
    assert flags.plan_folder(None, None) == Path("./stage_outputs")
    assert flags.plan_folder(["run_x"], "tiny-wan2.2") == Path("run_x")


def test_a_plan_whose_save_failed_does_not_exit_0(tmp_path, monkeypatch, capsys):
    """A full disk while saving: the plan is still printed and its JSON written, then one error line, exit 2."""

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executables, "_write_atomically", full_disk)
    report_path = tmp_path / "plan.json"
    argv = ["--plan", "v5e-8", "--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", tmp_path / "unused"]
    argv += ["--save_executables", tmp_path / "store", "--plan_json", report_path]
    expect_user_error(capsys, stage1_text_encoder, argv, "1 program(s) could not be saved (see the lines above")
    assert json.loads(report_path.read_text())["executables"]["failed"] == 1


def test_save_executables_is_refused_without_a_plan_and_for_several_hosts(capsys, tmp_path):
    message = "--save_executables needs --plan"
    expect_user_error(capsys, stage2_transformer, ["--save_executables", tmp_path], message)
    argv = ["--plan", "v6e-16", "--model", "tiny-wan2.1", "--save_executables", tmp_path]
    expect_user_error(capsys, stage2_transformer, argv, "v6e-16 spans 4 hosts")
    expect_user_error(capsys, stage3_vae_decoder, ["--save_executables", tmp_path], message)
    expect_user_error(capsys, stage3_vae_decoder, argv, "v6e-16 spans 4 hosts")
    assert not any(tmp_path.iterdir())


def test_abstract_weights_are_laid_out_as_placed_ones():
    """The plan's arguments (placement.abstract_weights) and a run's placed weights: same shapes, dtypes and
    shardings, a tied weight once, as its first name's rule lays it out."""
    from sharding import RuleTable
    from tpu_video.workarounds.torchax import import_torchax

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    module[1].weight = module[0].weight
    module.register_buffer("scale", torch.ones(4))
    table = RuleTable("test", ((r"0\.weight", ("tp", None)), (r"1\.weight", (None, "tp")), (r".*", ())))
    mesh = placement.make_mesh(MeshShape(dp=2, tp=4))
    abstract = placement.abstract_weights(module, table, mesh)
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    assert len(abstract) == len(named) - 1  # the tied weight once
    expected = {name: abstract[id(tensor)] for name, tensor in named}
    assert (
        expected["1.weight"].sharding.spec
        == expected["0.weight"].sharding.spec
        == jax.sharding.PartitionSpec("tp", None)
    )

    placement.place_module(module, table, mesh, import_torchax().default_env())
    placed = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    for name, tensor in placed:
        array = tensor.jax()
        assert (array.shape, array.dtype, array.sharding) == tuple(
            getattr(expected[name], field) for field in ("shape", "dtype", "sharding")
        ), name
