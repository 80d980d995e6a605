"""Stage 2's weights read straight from their files onto the devices (tpu_video/engine/direct_load.py).

The module `load_direct` builds is what `from_pretrained` loads, bit for bit once read: names, dtypes (Wan's
fp32-kept modules in a bf16 load), buffers, config; over one file and over a sharded checkpoint stored in
another dtype. Placed on the 2x2x2 mesh by each family's rule table, unrolled and under the block scan, the
device arrays equal those placed from the host copy (same bits, same shardings): the same computation
follows. A checkpoint the direct read cannot promise that for is loaded by from_pretrained, and LoRA or
quantization (which change the weights on the host) take that path too.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sharding import MeshShape
from tpu_video.cli import UserError
from tpu_video.engine import direct_load, scanned_blocks
from tpu_video.engine.denoise import DenoiseOptions, load_transformers
from tpu_video.engine.settings import Quantization
from tpu_video.models import resolve_model
from tpu_video.runtime import placement
from tpu_video.runtime.interface import Timer
from tpu_video.workarounds.torchax import import_torchax

MODELS = ["tiny-wan2.1", "tiny-wan2.2", "tiny-cogvideox", "tiny-hunyuanvideo15"]


def everything(tensor: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in tensor.shape)


def assert_loaded_alike(direct: torch.nn.Module, expected: torch.nn.Module) -> None:
    assert type(direct) is type(expected) and not direct.training
    assert json.dumps(dict(direct.config), default=str) == json.dumps(dict(expected.config), default=str)
    parameters = dict(expected.named_parameters())
    assert dict(direct.named_parameters()).keys() == parameters.keys()
    for name, tensor in direct.named_parameters():
        assert tensor.is_meta and tensor.dtype == parameters[name].dtype, name
        values = tensor.file_source.read(everything(tensor))
        assert values.dtype == parameters[name].dtype and torch.equal(values, parameters[name]), name
    buffers = dict(expected.named_buffers())
    assert dict(direct.named_buffers()).keys() == buffers.keys()
    for name, tensor in direct.named_buffers():
        assert tensor.dtype == buffers[name].dtype and torch.equal(tensor, buffers[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", MODELS)
def test_the_module_is_what_from_pretrained_loads(model, dtype):
    source, family = resolve_model(model)
    for component in family.transformer_components(source):
        assert_loaded_alike(direct_load.load_direct(source, component, dtype), source.load(component, dtype=dtype))


def test_a_sharded_checkpoint_stored_in_bf16_loads_in_fp32(tmp_path):
    source, _ = resolve_model("tiny-wan2.1")
    stored = source.load("transformer", dtype=torch.bfloat16)
    folder = tmp_path / "model"
    stored.save_pretrained(folder / "transformer", max_shard_size="20KB")
    (folder / "model_index.json").write_text(json.dumps(source.index))
    shards = sorted(path.name for path in (folder / "transformer").glob("*.safetensors"))
    assert len(shards) > 2
    copy, _ = resolve_model(str(folder))
    direct = direct_load.load_direct(copy, "transformer", torch.float32)
    assert_loaded_alike(direct, copy.load("transformer", dtype=torch.float32))
    assert {source.path for source in map(lambda t: t.file_source, direct.parameters())} == {
        str(folder / "transformer" / name) for name in shards
    }


def placed_arrays(module, rules, mesh, scan: bool) -> dict[str, jax.Array]:
    if scan:
        blocks = scanned_blocks.block_list(module)
        names = scanned_blocks.BlockScan(module, (0, len(blocks)), scan=None).stacked_names()
        rules = rules.with_stacked(set(names))
    stats = placement.place_module(module, rules, mesh, import_torchax().default_env())
    return {name: tensor.jax() for name, tensor in module.named_parameters()}, stats


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("model", ["tiny-wan2.1", "tiny-hunyuanvideo15", "tiny-cogvideox"])
def test_placed_from_the_files_as_from_the_host_copy(model, scan):
    source, family = resolve_model(model)
    mesh = placement.make_mesh(MeshShape(2, 2, 2))
    rules = family.transformer_rules("megatron")
    loaded = direct_load.load_direct(source, "transformer", torch.float32)
    direct, direct_stats = placed_arrays(loaded, rules, mesh, scan)
    host, host_stats = placed_arrays(source.load("transformer", dtype=torch.float32), rules, mesh, scan)
    assert direct.keys() == host.keys()
    assert direct_stats["read_from_files"] == len(direct) and host_stats["read_from_files"] == 0
    assert direct_stats["sharded"] == host_stats["sharded"] > 0
    for name, array in direct.items():
        assert array.sharding.is_equivalent_to(host[name].sharding, array.ndim), name
        assert np.array_equal(np.asarray(array), np.asarray(host[name])), name


def test_what_cannot_be_read_directly_is_loaded_by_from_pretrained(tmp_path, capsys):
    source, family = resolve_model("tiny-wan2.1")
    folder = tmp_path / "model"
    module = source.load("transformer")
    module.register_buffer("leftover", torch.ones(3))  # a tensor the class does not have
    module.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps(source.index))
    copy, _ = resolve_model(str(folder))
    assert direct_load.load_direct(copy, "transformer", torch.float32) is None
    said = capsys.readouterr().out
    assert "read on the host by from_pretrained (0 tensor(s) missing from the checkpoint, 1 not" in said
    loaded = load_transformers(family, copy, torch.float32, DenoiseOptions(), Timer())["transformer"]
    assert not any(tensor.is_meta for tensor in loaded.parameters())

    torch_only = tmp_path / "bin"
    module.save_pretrained(torch_only / "transformer", safe_serialization=False)
    (torch_only / "model_index.json").write_text(json.dumps(source.index))
    assert direct_load.load_direct(resolve_model(str(torch_only))[0], "transformer", torch.float32) is None


@pytest.mark.parametrize("damage", ["empty", "truncated", "header", "int32"])
def test_a_damaged_checkpoint_is_one_user_error(tmp_path, damage):
    """What direct loading reads is checked as it opens the files: a file safetensors cannot open (empty,
    cut short, a header that is not JSON) or an integer tensor where the module holds floats names the file or
    tensor, instead of a SafetensorError or RuntimeError traceback."""
    source, _ = resolve_model("tiny-wan2.1")
    folder = tmp_path / "model"
    module = source.load("transformer")
    module.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps(source.index))
    path = folder / "transformer" / direct_load.SAFETENSORS_NAME
    data = path.read_bytes()
    if damage == "int32":
        tensors = load_file(str(path))
        name = next(iter(tensors))
        save_file({**tensors, name: tensors[name].to(torch.int32)}, str(path))
        message = f"{name} is stored as I32 in the checkpoint"
    else:
        path.write_bytes(
            {"empty": b"", "truncated": data[: len(data) // 2], "header": b"\x08" + bytes(7) + b"{oops:1}"}[damage]
        )
        message = "is not a readable safetensors file"
    with pytest.raises(UserError, match=message):
        direct_load.load_direct(resolve_model(str(folder))[0], "transformer", torch.float32)


def test_a_checkpoint_missing_weights_or_naming_an_unknown_class_is_one_user_error(tmp_path):
    """A config with more blocks than the weights: from_pretrained leaves the missing ones on the meta device,
    which only placement found ("a meta tensor ... has no values"); an unknown class was an AttributeError."""
    source, family = resolve_model("tiny-wan2.1")
    folder = tmp_path / "model"
    source.load("transformer").save_pretrained(folder / "transformer")
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    (folder / "model_index.json").write_text(json.dumps(source.index))
    copy, _ = resolve_model(str(folder))
    with pytest.raises(UserError, match=r"the checkpoint has no values for blocks\.\d+\."):
        load_transformers(family, copy, torch.float32, DenoiseOptions(), Timer())
    config_path.write_text(json.dumps(config))  # the right blocks, one weight of another shape
    weights = folder / "transformer" / direct_load.SAFETENSORS_NAME
    tensors = load_file(str(weights))
    name = next(name for name, tensor in tensors.items() if tensor.dim() == 2)
    save_file({**tensors, name: torch.zeros(3, 5)}, str(weights))
    with pytest.raises(UserError, match="cannot load 'transformer' of .* \\(ValueError: "):
        load_transformers(family, resolve_model(str(folder))[0], torch.float32, DenoiseOptions(), Timer())
    (folder / "model_index.json").write_text(json.dumps({**source.index, "transformer": ["diffusers", "NoSuchModel"]}))
    with pytest.raises(UserError, match="model_index.json names diffusers.NoSuchModel"):
        resolve_model(str(folder))[0].load("transformer")


def test_lora_and_quantization_change_the_weights_on_the_host_first():
    source, family = resolve_model("tiny-wan2.1")
    plain = load_transformers(family, source, torch.float32, DenoiseOptions(), Timer())["transformer"]
    assert all(tensor.is_meta for tensor in plain.parameters())
    seen = []
    fused = DenoiseOptions(on_loaded=lambda transformers: seen.extend(transformers.values()))
    hosted = load_transformers(family, source, torch.float32, fused, Timer())["transformer"]
    assert seen == [hosted] and not any(tensor.is_meta for tensor in hosted.parameters())
    quantized = DenoiseOptions(quantization=Quantization("int8_weight"))
    hosted = load_transformers(family, source, torch.float32, quantized, Timer())["transformer"]
    assert not any(tensor.is_meta for tensor in hosted.parameters())


def test_weights_holding_nan_or_inf_are_named_before_anything_compiles(tmp_path):
    """A NaN in one weight and an Inf in another of a local checkpoint: placing the transformer on 8 devices
    names both, read from the files and on the host path (int8 quantization: their scales), while a finite
    weight whose float32 sum overflows is not named (the sum only selects what is checked element by element)."""
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    source, family = resolve_model("tiny-wan2.1")
    folder = tmp_path / "model"
    source.load("transformer").save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps(source.index))
    path = folder / "transformer" / direct_load.SAFETENSORS_NAME
    tensors = load_file(str(path))
    nan_name, inf_name, big_name = sorted(name for name, tensor in tensors.items() if tensor.dim() == 2)[:3]
    tensors[nan_name].view(-1)[3] = float("nan")
    tensors[inf_name].view(-1)[-1] = float("-inf")
    tensors[big_name].fill_(3e38)  # finite; 3e38 x its elements is not
    save_file(tensors, str(path))
    copy = resolve_model(str(folder))[0]
    runtime = TorchaxRuntime(placement.make_mesh(MeshShape(tp=8)))
    quantized = DenoiseOptions(quantization=Quantization("int8_weight"))
    for options, suffix in ((DenoiseOptions(), ""), (quantized, "_scale")):
        transformer = load_transformers(family, copy, torch.float32, options, Timer())["transformer"]
        with pytest.raises(UserError) as raised:
            runtime.compile(transformer, family.transformer_rules("megatron"))
        assert str(raised.value).startswith("2 weight(s) of the WanTransformer3DModel hold NaN or Inf values: ")
        named = str(raised.value).split(": ", 1)[1].split(" (")[0].split(", ")
        assert sorted(named) == sorted([nan_name + suffix, inf_name + suffix]), named
