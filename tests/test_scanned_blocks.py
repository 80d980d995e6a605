"""Blocks under one scan (tpu_video/engine/scanned_blocks.py, `--scan_blocks`): the scanned transformer computes what
the unrolled one does.

Stage 2 with `--scan_blocks on` against `off` on every family's tiny preset, on one device and on a 2x2x2
mesh with Splash (its exact-mask check runs inside the scanned body), fp32: 1e-5 relative (the same ops;
XLA may fuse a loop body differently from the blocks unrolled). The interval step cache scans its deep span
between the outer blocks; an eager Python loop over the stacked weights (TorchRuntime) is bit-identical to
the stock forward.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stage1_text_encoder
import stage2_transformer
from helpers import ROOT, expect_user_error, relative_error, run_stage
from sharding import COLUMN
from tpu_video.engine import cached_blocks, scanned_blocks
from tpu_video.models import wan
from tpu_video.runtime.interface import TorchRuntime
from utils import read_config, read_tensors

TOLERANCE = 1e-5
REQUEST = ["--height", "32", "--width", "48", "--num_frames", "5", "--num_inference_steps", "2", "--seed", "7"]
SIZES = {"tiny-cogvideox": ["--height", "64", "--width", "96", "--num_frames", "9"]}  # its VAE needs 8n+1 frames


def stage1(out, model):
    argv = ["--model", model, "--prompt", "a cat playing guitar", "--negative_prompt", "blurry", "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, *REQUEST, *SIZES.get(model, []), "--output_dir", out])
    return out


def stage2(folder, out, *flags):
    shutil.copytree(folder, out)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", "--warmup_steps", "0", *flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config["stage2"]


MODELS = ["tiny-wan2.1", "tiny-hunyuanvideo15", "tiny-cogvideox"]


@pytest.fixture(scope="module")
def one_device_runs(tmp_path_factory):
    """Every family's stage 1 (here), then stage 2 with --scan_blocks off and on in one process of one CPU
    device (one process for all: its start-up is most of what a run costs): {model: (folder, runs)}."""
    base = tmp_path_factory.mktemp("scan")
    folders, argvs, outs = {}, [], {}
    for model in MODELS:
        folders[model] = stage1(base / model / "stage1", model)
        for setting in ("off", "on"):
            out = base / model / f"one-device-{setting}"
            shutil.copytree(folders[model], out)
            outs.setdefault(model, []).append(out)
            flags = ["--executables", "off", "--warmup_steps", "0", "--scan_blocks", setting]
            argvs.append(["--input_dir", str(out), *flags])
    code = f"import helpers, stage2_transformer\nfor argv in {argvs!r}: helpers.run_stage(stage2_transformer, argv)"
    one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **one_device}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def result(out):
        record = read_config(out)["stage2"]
        return read_tensors(out, record)["latents"], record

    return {model: (folders[model], [result(out) for out in outs[model]]) for model in MODELS}


@pytest.mark.parametrize("model", MODELS)
def test_scanned_blocks_equal_the_unrolled_ones(tmp_path, model, one_device_runs):
    folder, ((unrolled, record), (scanned, scanned_record)) = one_device_runs[model]
    assert record["mesh"] == {"dp": 1, "sp": 1, "tp": 1}
    assert record["scan_blocks"] == {"setting": "off", "scanned": {"transformer": None}}
    assert scanned_record["scan_blocks"] == {"setting": "on", "scanned": {"transformer": [0, 2]}}
    assert scanned_record["placement"][0]["replicated"] < record["placement"][0]["replicated"]  # one per name
    assert relative_error(scanned, unrolled) <= TOLERANCE

    mesh = ["--dp", "2", "--sp", "2", "--tp", "2", "--attention", "splash"]  # Splash's mask check in the body
    unrolled, record = stage2(folder, tmp_path / "off", *mesh, "--scan_blocks", "off")
    scanned, scanned_record = stage2(folder, tmp_path / "on", *mesh, "--scan_blocks", "on")
    assert scanned_record["scan_blocks"]["scanned"] == {"transformer": [0, 2]}
    assert relative_error(scanned, unrolled) <= TOLERANCE


def test_interval_cache_scans_its_deep_span(tmp_path, four_layer_cogvideox):
    folder = tmp_path / "stage1"
    argv = ["--model", four_layer_cogvideox, "--prompt", "a cat", "--dtype", "fp32", "--output_dir", folder]
    run_stage(stage1_text_encoder, [*argv, "--height", "64", "--width", "96", "--num_frames", "9"])
    cache = ["--cache", "interval", "--cache_start_step", "1", "--cache_end_step", "7", "--cache_step_interval", "3"]
    unrolled, _ = stage2(folder, tmp_path / "off", *cache, "--num_inference_steps", "8", "--scan_blocks", "off")
    scanned, record = stage2(folder, tmp_path / "on", *cache, "--num_inference_steps", "8")  # auto
    assert record["scan_blocks"]["scanned"] == {"transformer": [1, 3]}  # blocks 0 and 3 run every step
    assert record["step_cache"]["schedule"] == "FFCCFCCF"
    assert relative_error(scanned, unrolled) <= TOLERANCE


def test_scan_blocks_on_is_refused_where_there_is_nothing_to_scan(capsys, tmp_path):
    """The interval cache on a 3-block model leaves one deep block: `on` says so, `auto` runs unrolled."""
    folder = tmp_path / "model"
    pipeline = wan.presets.tiny_pipeline("2.1")
    config = dict(pipeline.transformer.config)
    pipeline.transformer = type(pipeline.transformer).from_config({**config, "num_layers": 3})
    pipeline.save_pretrained(folder)
    out = stage1(tmp_path / "stage1", str(folder))
    window = ["--cache_start_step", "0", "--cache_end_step", "2"]  # within the 2 steps (checked first)
    flags = ["--input_dir", out, "--cache", "interval", *window, "--scan_blocks", "on", "--executables", "off"]
    expect_user_error(capsys, stage2_transformer, flags, "--scan_blocks on: WanTransformer3DModel: only 1 block(s)")


def test_blocks_that_differ_are_not_scanned():
    transformer = wan.presets.tiny_transformer()
    assert scanned_blocks.difference(transformer.blocks) is None
    transformer.blocks[1].attn1.heads = 4  # a value the forward reads, not a weight
    assert scanned_blocks.difference(transformer.blocks) == "block 1 differs from block 0"


def test_an_eager_loop_over_the_stacked_weights_is_the_stock_forward():
    """The scan's plumbing without JAX: hooks, carried arguments, stacking, the blocks that hand on."""
    config = dict(wan.presets.tiny_transformer().config)
    transformer = type(wan.presets.tiny_transformer()).from_config({**config, "num_layers": 4}).eval()
    generator = torch.Generator().manual_seed(2)
    for parameter in transformer.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    inputs = {
        "hidden_states": torch.randn(1, 16, 3, 4, 6, generator=generator),
        "timestep": torch.tensor([700]),
        "encoder_hidden_states": torch.randn(1, wan.transformer.MAX_SEQUENCE_LENGTH, 32, generator=generator),
    }
    calls = []
    for block in transformer.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape) and None)
    with torch.no_grad():
        expected = transformer(**inputs, return_dict=False)[0]
        scan = scanned_blocks.BlockScan(transformer, (0, 4), TorchRuntime().scan)
        assert [name for name, _ in transformer.named_parameters() if name.startswith("blocks.1.")] == []
        weight = dict(transformer.named_parameters())["blocks.0.attn1.to_q.weight"]
        assert weight.shape[0] == 4 and scan.stacked_names()[0].startswith("blocks.0.")
        calls.clear()
        got = transformer(**inputs, return_dict=False)[0]
    # Two computations (the stock blocks, a loop over stacked views): equal up to summation order, 1e-5 in fp32.
    assert relative_error(got, expected) <= 1e-5
    # the call that starts the scan, the scan's four blocks, and the three that hand on: hooks run as they did
    assert len(calls) == 1 + 4 + 3


def test_stacked_names_are_laid_out_as_one_block_with_the_stacked_dimension_whole():
    table = wan.transformer_rules().with_stacked({"blocks.0.attn1.to_q.weight"}).nested("transformer.")
    specs = table.assign([name for name, _ in _wan_parameter_names()])
    assert specs["transformer.blocks.0.attn1.to_q.weight"] == (None, *COLUMN)
    assert specs["transformer.blocks.1.attn1.to_q.weight"] == COLUMN


def _wan_parameter_names():
    return [(f"transformer.{name}", p) for name, p in wan.presets.tiny_transformer().named_parameters()]


def test_the_cache_span_is_the_scanned_span():
    assert cached_blocks.cache_span("interval", 30) == (1, 29)
    assert cached_blocks.cache_span("magcache", 30) == (0, 30)


def test_a_scan_span_is_cut_where_the_step_cache_span_starts_or_ends_inside_it():
    """Wan Animate 14B's face adapters after blocks 0, 5, ..., 35 make the spans (1, 6) ... (36, 40); the interval
    cache's span (1, 39) ends inside the last, so the scan runs blocks 36-38 and block 39 runs apart."""
    from tpu_video.engine.scanned_blocks import cut

    assert cut((36, 40), (1, 39)) == [(36, 39), (39, 40)]
    assert cut((0, 6), (1, 39)) == [(0, 1), (1, 6)]
    assert cut((1, 6), (1, 39)) == [(1, 6)]  # an edge on the span's own edge cuts nothing
    assert cut((2, 8), (3, 5)) == [(2, 3), (3, 5), (5, 8)]
    assert cut((0, 40), (0, 40)) == [(0, 40)]  # MagCache caches every block
