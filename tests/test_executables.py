"""Saved executables (tpu_video/runtime/executables.py, tpu_video/runtime/program_key.py,
tpu_video/program_checks.py): a program saved by one runtime is loaded by the next and gives bit-identical
results; whatever changes the program misses (the line names the part) and gives what jit gives; damaged and foreign
entries fall back with one line; checks inside a loaded program still raise; a second process reuses a stage's programs;
`--executables off` writes nothing."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import stage1_text_encoder
import stage2_transformer
from helpers import ROOT, run_script, run_stage
from sharding import MeshShape
from tpu_video.attention.cudnn import NOT_A_PREFIX
from tpu_video.attention.plan import fixed_plan
from tpu_video.cli import UserError, add_executables_argument
from tpu_video.runtime import executables, program_key
from tpu_video.runtime.placement import make_mesh
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime


class Toy(torch.nn.Module):
    """Attention through SDPA (so the attention plan counts), a baked-in scale, optional key padding."""

    def __init__(self, scale: float = 2.0, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 48).to(dtype)
        self.scale = scale

    def forward(self, x, valid=None):
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # each (B, heads, S, 8)
        mask = None if valid is None else valid[:, None, None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1) * self.scale


def run(store, module=None, x=None, valid=None, mesh=None, backend="cudnn"):
    """The toy's output through a fresh runtime with `--executables store`, and that runtime's store."""
    runtime = TorchaxRuntime(make_mesh(mesh or MeshShape()), executables=str(store))
    programs = runtime.compile(module or Toy())
    x = torch.linspace(-1, 1, 2 * 8 * 16).reshape(2, 8, 16) if x is None else x
    inputs = runtime.to_device((x, valid))
    with attention_backend(runtime.env, fixed_plan(backend), runtime.mesh, fused_implementation=None):
        return runtime.to_host(programs(*inputs)), runtime.executables


def test_a_saved_program_is_loaded_by_the_next_runtime_and_gives_the_same_bits(tmp_path, capsys):
    first, store = run(tmp_path)
    assert store.counts["saved"] == 1 and store.counts["misses"] == 1
    assert "none saved yet" in capsys.readouterr().out
    again, store = run(tmp_path)
    assert store.report() == {
        "mode": "folder",
        "hits": 1,
        "misses": 0,
        "saved": 0,
        "unusable": 0,
        "unsaveable": 0,
        "failed": 0,
    }
    assert "executables: loaded the saved " in capsys.readouterr().out
    assert torch.equal(again, first)
    jitted, store = run("off")
    assert torch.equal(jitted, first) and store.report()["mode"] == "off"


@pytest.mark.parametrize(
    "change, part",
    [
        ({"module": Toy(scale=3.0)}, "module"),  # a value the trace bakes in
        ({"x": torch.ones(2, 12, 16)}, "inputs"),
        ({"mesh": MeshShape(dp=2)}, "devices"),
        ({"backend": "xla"}, "attention"),
        ({"module": Toy(dtype=torch.bfloat16), "x": torch.ones(2, 8, 16, dtype=torch.bfloat16)}, "arguments"),
        ("libraries", "libraries"),
        ("source", "source"),
    ],
    ids=["baked value", "shape", "mesh", "attention plan", "dtype", "library version", "source"],
)
def test_what_changes_the_program_misses_names_the_part_and_equals_jit(tmp_path, capsys, monkeypatch, change, part):
    run(tmp_path)
    if change == "libraries":
        monkeypatch.setattr(program_key, "library_versions", lambda *names: {"jax": "0.0.1"})
    if change == "source":
        monkeypatch.setattr(program_key, "source_digest", lambda: "a fixed bug")
    change = change if isinstance(change, dict) else {}
    capsys.readouterr()
    got, store = run(tmp_path, **change)
    line = capsys.readouterr().out
    assert store.counts["hits"] == 0 and store.counts["misses"] == 1, line
    assert "differs in: " in line, line
    assert part in line.split("differs in: ")[1].split(")")[0].split(", "), line
    jitted, _ = run("off", **change)
    assert torch.equal(got, jitted)


def test_damaged_and_foreign_entries_fall_back_with_one_line(tmp_path, capsys):
    expected, _ = run(tmp_path)
    (entry,) = tmp_path.glob("*.executable")
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated
    capsys.readouterr()
    got, store = run(tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if "executables:" in line and "unusable" in line]
    assert len(lines) == 1 and store.counts["unusable"] == 1 and torch.equal(got, expected)
    assert store.counts["saved"] == 1  # and replaced by a good one
    # another program's entry under this program's name
    run(tmp_path, x=torch.ones(2, 4, 16))
    other = next(path for path in tmp_path.glob("*.executable") if path != entry)
    shutil.copyfile(other, entry)
    got, store = run(tmp_path)
    assert "not an entry of this store's format for this key" in capsys.readouterr().out
    assert store.counts["unusable"] == 1 and torch.equal(got, expected)


def test_the_auto_store_drops_its_least_recently_used_entries(tmp_path, monkeypatch, capsys):
    """Past $TPU_VIDEO_EXECUTABLES_GIB the auto store drops the entries used longest ago (a load is a use); a
    folder given as --executables DIR is the user's and is never pruned."""
    monkeypatch.setenv("TPU_VIDEO_CACHE", str(tmp_path))
    shapes = {name: torch.ones(2, length, 16) for name, length in (("a", 8), ("b", 4), ("c", 12))}
    run("auto", x=shapes["a"])
    (first,) = (tmp_path / "executables" / "cpu").glob("*.executable")
    monkeypatch.setenv(executables.AUTO_LIMIT_VARIABLE, str(2.5 * first.stat().st_size / 2**30))
    run("auto", x=shapes["b"])
    (second,) = set((tmp_path / "executables" / "cpu").glob("*.executable")) - {first}
    _, store = run("auto", x=shapes["a"])  # a is used again: b is now the least recently used
    assert store.counts["hits"] == 1
    capsys.readouterr()
    _, store = run("auto", x=shapes["c"])
    assert store.counts["saved"] == 1 and "dropped the 1 least recently used entries" in capsys.readouterr().out
    left = set((tmp_path / "executables" / "cpu").iterdir())
    assert first in left and first.with_suffix(".json") in left and len(left) == 4
    assert second not in left and second.with_suffix(".json") not in left
    assert executables.store_from_flag(str(tmp_path / "mine"), "cpu").limit_bytes is None
    parser = argparse.ArgumentParser()
    add_executables_argument(parser)
    help_text = " ".join(parser.format_help().split())
    assert f"$TPU_VIDEO_EXECUTABLES_GIB (default {executables.AUTO_LIMIT_GIB:g})" in help_text
    for value in ("0", "inf", "1e400", "nan"):
        monkeypatch.setenv(executables.AUTO_LIMIT_VARIABLE, value)
        with pytest.raises(UserError, match=f"TPU_VIDEO_EXECUTABLES_GIB='{value}': give the auto executable store"):
            executables.store_from_flag("auto", "cpu")
    monkeypatch.setenv(executables.AUTO_LIMIT_VARIABLE, "")  # set but empty: the default
    assert executables.store_from_flag("auto", "cpu").limit_bytes == int(executables.AUTO_LIMIT_GIB * 2**30)


def test_a_failed_save_leaves_no_temporary_and_pruning_clears_abandoned_ones(tmp_path, monkeypatch):
    """A save that fails (here its entry path is a folder; a full disk alike) removes its temporary, and the
    auto store's pruning removes temporaries an hour old (a killed process's), which no entry glob counts."""
    blocked = tmp_path / "x.executable"
    blocked.mkdir()
    with pytest.raises(OSError):
        executables._write_atomically(blocked, b"payload")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["x.executable"]

    monkeypatch.setenv("TPU_VIDEO_CACHE", str(tmp_path / "cache"))
    store_dir = tmp_path / "cache" / "executables" / "cpu"
    store_dir.mkdir(parents=True)
    old, fresh = store_dir / ".k1.executable.99.tmp", store_dir / ".k2.executable.98.tmp"
    for path in (old, fresh):
        path.write_bytes(b"half")
    os.utime(old, (time.time() - 2 * executables.ABANDONED_SECONDS,) * 2)
    run("auto", x=torch.ones(2, 8, 16))  # saves one entry, then prunes
    assert not old.exists() and fresh.exists()


def test_a_check_inside_a_loaded_program_still_raises(tmp_path):
    """The cuDNN backend's prefix check (no host callback: tpu_video.program_checks) in a loaded program."""
    prefix = torch.tensor([[True] * 6 + [False] * 2] * 2)
    run(tmp_path, valid=prefix)
    hole = prefix.clone()
    hole[1, 2] = False
    with pytest.raises(ValueError) as raised:
        run(tmp_path, valid=hole)
    assert str(raised.value) == NOT_A_PREFIX


def test_what_cannot_be_keyed_is_compiled_and_not_saved(tmp_path, capsys):
    module = Toy()
    module.generator = torch.Generator()  # no plain value describes it
    got, store = run(tmp_path, module=module)
    assert "cannot be saved" in capsys.readouterr().out
    assert store.counts["unsaveable"] == 1 and not list(tmp_path.glob("*.executable"))
    assert torch.equal(got, run("off")[0])


def test_a_failure_while_keying_costs_a_compile_not_the_run(tmp_path, capsys, monkeypatch):
    def broken(mesh, process=None):
        raise RuntimeError("no key today")

    monkeypatch.setattr(program_key, "environment_parts", broken)
    got, store = run(tmp_path)
    assert "describing it failed: RuntimeError: no key today" in capsys.readouterr().out
    assert store.counts["unsaveable"] == 1 and torch.equal(got, run("off")[0])


def test_the_source_digest_covers_every_module_pyproject_ships():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [name.rstrip("*") for name in setup["packages"]["find"]["include"]]
    assert sorted(program_key.PRODUCT) == sorted(setup["py-modules"] + packages)


def latents(folder: Path) -> np.ndarray:
    return load_file(folder / "stage2_latents.safetensors")["latents"]


def test_a_second_process_loads_stage2_programs_and_off_writes_nothing(tmp_path, monkeypatch):
    """tiny HunyuanVideo-1.5 (text masks: its programs carry checks): saved in this process, loaded by a
    real second one with bit-identical latents; then `--executables off` writes nothing."""
    out, store = tmp_path / "out", tmp_path / "store"
    run_stage(stage1_text_encoder, ["--model", "tiny-hunyuanvideo15", "--prompt", "a cat", "--output_dir", out])

    def stage2_record():
        return json.loads((out / "generation_config.json").read_text())["stage2"], latents(out)

    run_stage(stage2_transformer, ["--input_dir", out, "--executables", store])
    first, first_latents = stage2_record()
    result = run_script("stage2_transformer.py", ["--input_dir", out, "--executables", store], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    second, second_latents = stage2_record()
    assert first["executables"]["saved"] >= 1 and first["executables"]["hits"] == 0
    assert second["executables"]["hits"] == first["executables"]["saved"] and second["executables"]["misses"] == 0
    assert "loaded the saved tpu_video.models.hunyuanvideo15.transformer.GuidedTransformer.forward" in result.stdout
    assert second["seconds"]["trace"] == 0 and second["seconds"]["compile"] == 0
    assert np.array_equal(first_latents, second_latents)

    entries = sorted(path.name for path in store.iterdir())
    monkeypatch.setenv("TPU_VIDEO_CACHE", str(tmp_path / "cache"))
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off"])
    off, off_latents = stage2_record()
    assert sorted(path.name for path in store.iterdir()) == entries
    assert not (tmp_path / "cache" / "executables").exists()
    assert off["executables"]["mode"] == "off" and np.array_equal(off_latents, first_latents)


def test_a_new_guidance_scale_misses_and_a_new_step_count_reuses_the_program(tmp_path, capsys):
    """Wan bakes its guidance scale into the program (an attribute of the guided transformer): a new one
    misses, naming the module, and equals the run without a store; the step count only changes the
    inputs' values (timesteps), so the same program serves it, and equals the run without a store."""
    out, store = tmp_path / "out", tmp_path / "store"
    run_stage(stage1_text_encoder, ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", out])
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", store])
    for flags, part in ((["--guidance_scale", "7.5"], "module"), (["--num_inference_steps", "4"], None)):
        capsys.readouterr()
        run_stage(stage2_transformer, ["--input_dir", out, "--executables", store, *flags])
        record, got = json.loads((out / "generation_config.json").read_text())["stage2"], latents(out)
        line = capsys.readouterr().out
        if part is None:
            assert record["executables"]["hits"] == 1 and record["executables"]["misses"] == 0, line
        else:
            assert record["executables"]["misses"] == 1 and f"differs in: {part})" in line, line
        run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *flags])
        assert np.array_equal(got, latents(out))


def test_the_same_configuration_from_another_folder_keys_alike(tmp_path):
    """Where a checkpoint came from (`_name_or_path`, versions; a transformers model's own `name_or_path`) is no
    part of a program's key: a diffusers transformer and a transformers text encoder loaded from two folders,
    and the text encoder as stage 1's plan builds it from the config alone (the path's key held the folder
    until 2026-11-26, so a plan's saved text-encoder programs missed on a VM with the model elsewhere)."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from tpu_video import models
    from tpu_video.engine.meta import meta_pretrained

    preset = models.materialize_preset("tiny-wan2.1")
    shutil.copytree(preset, tmp_path / "elsewhere")

    def described(module):
        return program_key.Describer({id(t) for t in (*module.parameters(), *module.buffers())})(module)

    folders = (preset, tmp_path / "elsewhere")
    loaded = [WanTransformer3DModel.from_pretrained(folder / "transformer") for folder in folders]
    assert loaded[0].config["_name_or_path"] != loaded[1].config["_name_or_path"]
    assert described(loaded[0]) == described(loaded[1])

    encoders = [UMT5EncoderModel.from_pretrained(folder / "text_encoder").eval() for folder in folders]
    assert encoders[0].name_or_path != encoders[1].name_or_path
    source, _ = models.resolve_model("tiny-wan2.1")
    planned = meta_pretrained(source, "text_encoder", torch.float32)
    assert described(encoders[0]) == described(encoders[1]) == described(planned)


def test_stages_1_and_3_load_their_programs_too(tmp_path):
    """tiny Wan with `--backend torchax`: the stage-1 encoder program and stage 3's two frame programs are
    saved by the first run and loaded by the second, with bit-identical embeddings and frames."""
    import stage3_vae_decoder
    from utils import read_config, read_tensors

    store = ["--executables", tmp_path / "store"]
    for name in ("a", "b"):
        argv = ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", tmp_path / name, "--backend", "torchax"]
        run_stage(stage1_text_encoder, [*argv, *store])
    first, second = (read_config(tmp_path / name, needs="stage1")["stage1"] for name in ("a", "b"))
    assert first["executables"]["saved"] >= 1 and second["executables"]["hits"] == first["executables"]["saved"]
    assert second["executables"]["misses"] == 0
    embeddings = [read_tensors(tmp_path / name, read_config(tmp_path / name)["stage1"]) for name in ("a", "b")]
    assert embeddings[0].keys() == embeddings[1].keys()
    assert all(torch.equal(embeddings[0][key], embeddings[1][key]) for key in embeddings[0])

    out = tmp_path / "a"
    run_stage(stage2_transformer, ["--input_dir", out, *store])
    frames, records = [], []
    for _ in range(2):
        run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torchax", "--save_frames", *store])
        config = read_config(out, needs="stage3")
        records.append(config["stage3"]["executables"])
        frames.append(read_tensors(out, config["stage3"]["frames_file"])["frames_float"])
    assert records[0]["saved"] == 2 and records[1]["hits"] == 2 and records[1]["misses"] == 0
    assert torch.equal(frames[0], frames[1])
