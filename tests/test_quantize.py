"""Quantized weights (`--quantize`, `--quantize_layers`): each scheme against torchao 0.18 itself (integers,
scales, a linear's output), and stage 2 on every family's tiny preset against its diffusers pipeline run
eagerly with the same linears quantized by the same rule, fp32.

torchao is the schemes' reference, installed by `make install` into `<venv>/torchao-reference` and put on the
path of one subprocess only: diffusers imports any torchao it finds at start-up (and torchao 0.18 prints
that its CUDA extensions fail to load), which the product's own runs must not pay for.

The pipeline reference replaces the same linears (the blocks' attention and feed-forward projections, chosen
here by name) with: for the weight-only schemes, an `nn.Linear` holding the dequantized weight (integers x
scale, in fp32); for `int8`, each token's activations quantized with the same fp32 arithmetic and the integer
matmul and both rescales in float64. The tolerance is the families' staged-vs-pipeline 1e-4 relative.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stage2_transformer
from helpers import (
    ROOT,
    dequantized,
    expect_user_error,
    pipeline,
    pipeline_latents,
    relative_error,
    staged,
    stop_stage2_after,
)
from tpu_video.engine.quantize import ACTIVATION_LEVELS, int8_per_row

TOLERANCE = 1e-4
TORCHAO = Path(sys.prefix) / "torchao-reference"
LINEARS = {  # every linear in the blocks, by name (what --quantize_layers all selects)
    "wan": r"blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)|ffn\.net\.(0\.proj|2))",
    "cogvideox": r"transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2)|norm[12]\.linear)",
    "hunyuanvideo15": r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_[qkv]_proj|to_add_out)"
    r"|(ff|ff_context)\.net\.(0\.proj|2)|(norm1|norm1_context)\.linear)",
}
FFN = r".*\.(ffn|ff|ff_context)\.net\.(0\.proj|2)"
PRESETS = [("tiny-wan2.1", "wan"), ("tiny-cogvideox", "cogvideox"), ("tiny-hunyuanvideo15", "hunyuanvideo15")]

AGAINST_TORCHAO = r"""
import json, torch
from torchao.kernel.intmm import int_scaled_matmul
from torchao.quantization import Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine
from tpu_video.engine.quantize import QuantizedLinear

CONFIGS = {"int8_weight": Int8WeightOnlyConfig, "int8": Int8DynamicActivationInt8WeightConfig,
           "fp8_weight": Float8WeightOnlyConfig}


def int8_reduced_range(linear, x):
    # torchao's int8 x int8 linear with the activations on [-127, 127] (scale max |x| / 127), by its primitives
    rows, weight = x.reshape(-1, x.shape[-1]), linear.weight
    block = (1, rows.shape[-1])
    scale, zero = choose_qparams_affine(rows, MappingType.SYMMETRIC, block, torch.int8, -127, 127,
                                        torch.finfo(torch.float32).eps, torch.float32, torch.int8)
    values = quantize_affine(rows, block, scale, zero, torch.int8, -127, 127)
    y = int_scaled_matmul(values, weight.qdata.t(), scale.reshape(-1, 1)).to(x.dtype)
    return ((y * weight.scale.flatten()).reshape(*x.shape[:-1], -1) + linear.bias).to(x.dtype)


results = {}
for dtype in (torch.float32, torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40).to(dtype)
    with torch.no_grad():  # rows of magnitudes from 1e-3 to 10
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * torch.logspace(-3, 1, 40)[:, None])
    x = torch.randn(2, 7, 96, generator=generator).to(dtype)
    for scheme, config in CONFIGS.items():
        ours = QuantizedLinear(linear, scheme)
        theirs = torch.nn.Linear(96, 40).to(dtype)
        theirs.load_state_dict(linear.state_dict())
        quantize_(theirs, config())
        same_values = torch.equal(ours.weight.view(torch.int8), theirs.weight.qdata.view(torch.int8))
        same_scales = torch.equal(ours.weight_scale, theirs.weight.scale.reshape(-1).to(torch.float32))
        with torch.no_grad():
            mine = ours(x)
            reference = int8_reduced_range(theirs, x) if scheme == "int8" else theirs(x)
        error = ((mine.double() - reference.double()).norm() / reference.double().norm()).item()
        results[f"{scheme} {dtype}"] = [same_values, same_scales, error, mine.dtype == reference.dtype]
print(json.dumps(results))
"""


def test_schemes_match_torchao():
    """Weight integers and scales equal torchao's bit for bit, in fp32 and bf16; a linear's output equals
    torchao's (`int8`: its primitives with the activations on [-127, 127], tpu_video/engine/quantize.py says why) to
    float rounding: the integer paths are the same ops; for fp8 torchao dequantizes the weight before the
    matmul and we scale the product."""
    assert TORCHAO.is_dir(), f"{TORCHAO} is missing: `make install` puts torchao 0.18 there"
    env = {"PYTHONPATH": f"{TORCHAO}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", AGAINST_TORCHAO], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == 6
    bounds = {"float32": 1e-6, "bfloat16": 0.0}  # bf16: the same ops in the same order
    for case, (same_values, same_scales, error, same_dtype) in results.items():
        assert same_values and same_scales and same_dtype, case
        scheme, dtype = case.split(" torch.")
        bound = 1e-2 if (scheme, dtype) == ("fp8_weight", "bfloat16") else bounds[dtype]  # torchao: bf16 weights
        assert error <= bound, (case, error)


class ReferenceInt8Linear(torch.nn.Module):
    """`int8` eagerly: activations quantized per token in fp32 as ours, accumulation and rescale in float64."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.values, self.scale = int8_per_row(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        values, scale = int8_per_row(rows, ACTIVATION_LEVELS)
        y = (values.double() @ self.values.double().t()) * scale.double() * self.scale.double().t()
        y = y.reshape(*x.shape[:-1], -1) + self.bias.double()
        return y.to(x.dtype)


def quantize_reference(transformer: torch.nn.Module, family: str, scheme: str, pattern: str | None = None) -> int:
    """Quantize the reference transformer's selected linears (by name) in place; how many there were."""
    pattern = pattern or LINEARS[family]
    chosen = [name for name, module in transformer.named_modules() if re.fullmatch(pattern, name)]
    for name in chosen:
        parent, _, attribute = name.rpartition(".")
        owner = transformer.get_submodule(parent)
        linear = getattr(owner, attribute)
        assert type(linear) is torch.nn.Linear, name
        setattr(owner, attribute, ReferenceInt8Linear(linear) if scheme == "int8" else dequantized(linear, scheme))
    return len(chosen)


# Which linears are quantized is the family's; how is the scheme's. int8_weight on every family, fp8_weight
# where the eager reference pipeline is quick (HunyuanVideo-1.5's takes ~12 s of the suite).
CASES = [(preset, family, "int8_weight") for preset, family in PRESETS]
CASES += [(preset, family, "fp8_weight") for preset, family in PRESETS if family != "hunyuanvideo15"]


@pytest.mark.parametrize("preset,family,scheme", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_weight_only_stage2_matches_the_pipeline_with_the_same_dequantized_weights(tmp_path, preset, family, scheme):
    latents, config = staged(tmp_path / "run", preset, stage2_flags=["--quantize", scheme])
    assert config["stage2"]["quantize"] == {"scheme": scheme, "layers": "all"}
    pipe = pipeline(preset)
    assert quantize_reference(pipe.transformer, family, scheme) > 0
    expected = pipeline_latents(pipe, config)
    assert relative_error(latents, expected) <= TOLERANCE
    unquantized = pipeline_latents(pipeline(preset), config)
    assert relative_error(latents, unquantized) > 10 * relative_error(latents, expected)  # quantized for real


def test_feed_forward_only_on_wan(tmp_path):
    """`--quantize_layers ffn` quantizes the feed-forward linears and leaves attention as it was."""
    flags = ["--quantize", "int8_weight", "--quantize_layers", "ffn"]
    latents, config = staged(tmp_path / "run", "tiny-wan2.1", stage2_flags=flags)
    assert config["stage2"]["quantize"] == {"scheme": "int8_weight", "layers": "ffn"}
    pipe = pipeline("tiny-wan2.1")
    assert quantize_reference(pipe.transformer, "wan", "int8_weight", FFN) == 2 * pipe.transformer.config.num_layers
    assert relative_error(latents, pipeline_latents(pipe, config)) <= TOLERANCE


def transformer_and_inputs(family: str):
    """A tiny transformer of the family, adapted for jit as stage 2 runs it, and one call's inputs (a batch of 2)."""
    from helpers import hunyuan_inputs, tiny_hunyuan_transformer
    from tpu_video import models
    from tpu_video.models import cogvideox, hunyuanvideo15

    if family == "hunyuanvideo15":
        return hunyuanvideo15.transformer.make_jit_safe(tiny_hunyuan_transformer()), hunyuan_inputs()
    source, _ = models.resolve_model(f"tiny-{'wan2.1' if family == 'wan' else family}")
    transformer = source.load("transformer", dtype=torch.float32).eval()
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    if family == "cogvideox":
        frames, text = (2, 2, config.in_channels, 8, 12), (2, config.max_text_seq_length, config.text_embed_dim)
    else:
        frames, text = (2, config.in_channels, 2, 4, 6), (2, 24, config.text_dim)
    inputs = {
        "hidden_states": torch.randn(*frames, generator=generator),
        "encoder_hidden_states": torch.randn(*text, generator=generator),
        "timestep": torch.tensor([500, 500]),
    }
    return (cogvideox.transformer.make_jit_safe(transformer) if family == "cogvideox" else transformer), inputs


class Captured(torch.nn.Module):
    """The transformer's output, then each quantized linear's input and output in call order, as program outputs;
    `names` the linears in that order (filled while the program is traced)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        from tpu_video.engine.quantize import QuantizedLinear

        self.transformer = transformer
        self.seen: list[torch.Tensor] = []
        self.names: list[str] = []
        for name, module in transformer.named_modules():
            if isinstance(module, QuantizedLinear):
                module.register_forward_hook(functools.partial(self.record, name))

    def record(self, name, module, args, output):
        self.names.append(name)
        self.seen.extend((args[0], output))

    def forward(self, **kwargs):
        self.seen, self.names = [], []
        output = self.transformer(**kwargs, return_dict=False)[0]
        return (output, *self.seen)


@pytest.mark.parametrize(
    "family,mesh", [("wan", (1, 1, 1)), ("wan", (2, 2, 2)), ("cogvideox", (1, 1, 1)), ("hunyuanvideo15", (1, 2, 4))]
)
def test_int8_linears_in_the_compiled_transformer_match_the_reference(family, mesh):
    """`int8` quantizes activations at run time, so an integer flips where a value sits within the last bit of
    a rounding tie: over a whole denoise on these tiny models the 1e-7 differences between XLA and eager
    PyTorch flip a few and move the latents by up to 6e-3 (docs/quantization.md), as they move the reference
    itself when its latents are scaled by 1 + 1e-7. So each quantized linear of the compiled transformer (on
    one device, and with its weights and scales split on tp) is checked on the input it received in the
    program: its output there against the eager reference's on that same input, within 1e-6."""
    from sharding import MeshShape
    from tpu_video.engine.quantize import quantize
    from tpu_video.engine.settings import Quantization
    from tpu_video.models import FAMILIES
    from tpu_video.runtime.placement import make_mesh
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    transformer, inputs = transformer_and_inputs(family)
    reference = copy.deepcopy(transformer)
    linears = quantize_reference(reference, family, "int8")
    quantize({"transformer": transformer}, Quantization("int8"))
    runtime = TorchaxRuntime(make_mesh(MeshShape(*mesh)))
    rules = FAMILIES[family].transformer_rules("megatron").nested("transformer.")
    captured = Captured(transformer)
    compiled = runtime.compile(captured, rules)
    with runtime.precision(torch.float32):
        output, *seen = (runtime.to_host(tensor) for tensor in compiled(**runtime.to_device(inputs)))
    assert len(seen) == 2 * linears and len(set(captured.names)) == linears  # each quantized linear ran once
    with torch.no_grad():
        for name, given, computed in zip(captured.names, seen[::2], seen[1::2], strict=True):
            assert relative_error(computed, reference.get_submodule(name)(given)) <= 1e-6, name
        expected = reference(**inputs, return_dict=False)[0]
    assert relative_error(output, expected) <= 1e-3  # the whole call: a few flips at most (see above)


def test_resuming_with_another_scheme_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    staged(out, "tiny-wan2.1", stage2_flags=["--quantize", "int8_weight"])
    argv = ["--input_dir", out, "--quantize", "int8_weight"]
    stop_stage2_after(monkeypatch, argv, steps=2)
    expect_user_error(capsys, stage2_transformer, ["--input_dir", out, "--resume"], "different request")
    expect_user_error(capsys, stage2_transformer, [*argv, "--resume", "--quantize", "fp8_weight"], "different request")


def test_magcache_ratios_are_keyed_by_the_quantization(tmp_path, capsys):
    """Ratios calibrated with one --quantize serve only runs with the same one (as for LoRA adapters)."""
    from helpers import run_stage
    from tpu_video.engine.mag_ratios import MAG_RATIOS_FILE

    out = tmp_path / "run"
    staged(out, "tiny-wan2.1", stage2_flags=["--quantize", "int8_weight", "--cache_calibrate"])
    written = json.loads((out / MAG_RATIOS_FILE).read_text())
    assert written["quantize"] == {"scheme": "int8_weight", "layers": "all"}
    magcache = ["--input_dir", out, "--cache", "magcache"]
    expect_user_error(capsys, stage2_transformer, magcache, "calibrated with --quantize")
    ffn_only = [*magcache, "--quantize", "int8_weight", "--quantize_layers", "ffn"]
    expect_user_error(capsys, stage2_transformer, ffn_only, "calibrated with --quantize")
    run_stage(stage2_transformer, [*magcache, "--quantize", "int8_weight"])  # the same: it runs
    unquantized = tmp_path / "unquantized.json"
    unquantized.write_text(json.dumps({key: value for key, value in written.items() if key != "quantize"}))
    flags = [*magcache, "--cache_mag_ratios", unquantized, "--quantize", "int8_weight"]
    expect_user_error(capsys, stage2_transformer, flags, "calibrated with unquantized weights")


def test_fp8_without_e4m3_in_jax_is_an_error(tmp_path, monkeypatch, capsys):
    import jax.numpy as jnp

    out = tmp_path / "run"
    staged(out, "tiny-wan2.1")
    monkeypatch.delattr(jnp, "float8_e4m3fn")
    argv = ["--input_dir", out, "--quantize", "fp8_weight"]
    expect_user_error(capsys, stage2_transformer, argv, "cannot store float8_e4m3fn")


def test_plan_counts_quantized_weights_read_by_the_matmuls(tmp_path):
    """`--plan` with the TPU compiler: the quantized weights shrink the plan's arguments, every quantized
    linear's matmul reads its int8 or e4m3 weight directly (the TPU's convolution takes it as an operand), and
    no dequantized copy of a weight is stored. Blocks under one scan (int8 here) are counted as often as they
    run, not once as the scan's body appears in the HLO."""
    from helpers import run_stage

    reports = {}
    for scheme, scan in (("none", "off"), ("int8", "on"), ("fp8_weight", "off")):
        report = tmp_path / f"{scheme}.json"
        argv = [
            "--input_dir",
            tmp_path,
            "--plan",
            "v6e-8",
            "--model",
            "tiny-wan2.1",
            "--dtype",
            "bf16",
            "--scan_blocks",
            scan,
        ]
        run_stage(stage2_transformer, [*argv, "--quantize", scheme, "--plan_json", report])
        reports[scheme] = json.loads(report.read_text())
    assert reports["int8"]["collectives"]["scanned_blocks"] == 2
    linears = 2 * 10  # 2 blocks of 8 attention and 2 feed-forward linears
    none = reports["none"]["hbm_bytes_per_device"]["arguments"]
    for scheme in ("int8", "fp8_weight"):
        report = reports[scheme]
        assert report["quantize"] == {"scheme": scheme, "layers": "all", "matmuls": linears, "dequantized": 0}
        assert report["hbm_bytes_per_device"]["arguments"] < none
    assert "quantize" not in reports["none"]
    assert reports["int8"]["step_seconds_lower_bound_int8"] < reports["int8"]["step_seconds_lower_bound"]
    assert "step_seconds_lower_bound_int8" not in reports["fp8_weight"]


def test_scales_are_laid_out_as_their_weights_output_dimension():
    from sharding import COLUMN, ROW, TP, RuleTable

    table = RuleTable("t", ((r"a\.weight", COLUMN), (r"b\.weight", ROW))).with_stacked({"a.weight_scale"})
    specs = table.assign(["a.weight", "a.weight_scale", "b.weight", "b.weight_scale"])
    assert specs["a.weight_scale"] == (None, TP) and specs["b.weight_scale"] == (None,)
    with pytest.raises(ValueError, match="without a rule"):
        table.assign(["a.weight", "b.weight", "c.weight_scale"])


def test_the_mesh_choice_counts_quantized_bytes():
    """The default mesh weighs the weights as stored: Wan 2.1 14B's (published config, meta device) in
    int8_weight are at most 0.55x of bf16's (the blocks' linears are nearly all of them)."""
    from tpu_video import models
    from tpu_video.engine.meta import model_facts
    from tpu_video.engine.settings import Quantization

    source, family = models.resolve_model("Wan-AI/Wan2.1-T2V-14B-Diffusers", configs_only=True)

    def total(quantization):
        facts = model_facts(family, source, torch.bfloat16, "megatron", quantization=quantization)
        return facts.replicated_bytes + sum(size for _, size in facts.split_bytes)

    assert total(Quantization("int8_weight")) <= 0.55 * total(Quantization())
    assert total(Quantization("fp8_weight")) == total(Quantization("int8_weight"))


def test_a_stored_dequantized_copy_is_counted():
    """planning.hlo.quantized_reads on an XLA:CPU program: the CPU converts an int8 weight in a fusion of its
    own and its dot reads the stored float copy (where the TPU's convolution reads the int8 array itself)."""
    import jax
    import jax.numpy as jnp

    from tpu_video.planning.hlo import quantized_reads

    weight, x = jnp.ones((64, 32), jnp.int8), jnp.ones((8, 64), jnp.float32)
    compiled = jax.jit(lambda w, x: x @ w.astype(jnp.float32)).lower(weight, x).compile()
    assert quantized_reads(compiled.as_text()) == {"matmuls": 0, "dequantized": 1}


def test_an_adapter_is_fused_before_the_weights_are_quantized(tmp_path):
    """`--lora` with `--quantize int8_weight`: the reference fuses the adapter into its weights with diffusers'
    own fuse_lora, then quantizes the fused weights."""
    from helpers import diffusers_file

    adapter = diffusers_file(tmp_path, "adapter.safetensors", "tiny-wan2.1", seed=8)
    flags = ["--lora", adapter, "--quantize", "int8_weight"]
    latents, config = staged(tmp_path / "run", "tiny-wan2.1", stage2_flags=flags)
    pipe = pipeline("tiny-wan2.1")
    pipe.load_lora_weights(adapter)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    assert quantize_reference(pipe.transformer, "wan", "int8_weight") > 0
    assert relative_error(latents, pipeline_latents(pipe, config)) <= TOLERANCE
