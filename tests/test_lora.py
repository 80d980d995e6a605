"""LoRA adapters (`--lora`, `--lora_2`) through the real stage-2 CLI against the diffusers pipelines with the
same adapters loaded their own way, on the tiny presets, fp32.

Adapters are made here: PEFT `LoraConfig` on the blocks' attention and MLP projections with random, nonzero
A and B, saved as diffusers saves them (`transformer.` keys), or in a community format diffusers converts
(Wan's original `diffusion_model.*.lora_down/lora_up` + alpha; CogVideoX's older `.lora.down/.lora.up`).
Stage 2 fuses them into the weights; the pipelines keep them as separate layers, so the tolerance is the
families' staged-vs-pipeline 1e-4 relative on the final latents.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image

import stage1_text_encoder
import stage2_transformer
from helpers import (
    PIPELINE_REQUEST,
    PROMPT,
    diffusers_file,
    expect_user_error,
    peft_weights,
    pipeline,
    pipeline_latents,
    relative_error,
    run_stage,
    staged,
    stop_stage2_after,
)
from tpu_video import models
from utils import CONFIG_FILE

TOLERANCE = 1e-4
# diffusers' Wan names -> the original Wan checkpoints' (what _convert_non_diffusers_wan_lora_to_diffusers reads)
WAN_ORIGINAL = {"attn1.": "self_attn.", "attn2.": "cross_attn.", "to_q": "q", "to_k": "k", "to_v": "v"}
WAN_ORIGINAL |= {"to_out.0": "o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def community_file(folder, name: str, preset: str, seed: int):
    """The adapter in a community format that diffusers' loader converts (alpha 2x the rank for Wan)."""
    from safetensors.torch import save_file

    weights, _ = peft_weights(preset, seed)
    out = {}
    for key, tensor in weights.items():
        if preset.startswith("tiny-wan"):
            for ours, theirs in WAN_ORIGINAL.items():
                key = key.replace(ours, theirs)
            key = "diffusion_model." + key.replace("lora_A", "lora_down").replace("lora_B", "lora_up")
            if "lora_down" in key:
                out[key.replace("lora_down.weight", "alpha")] = torch.tensor(2.0 * tensor.shape[0])
        else:
            key = "transformer." + key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.")
        out[key] = tensor.contiguous()
    save_file(out, folder / name)
    return folder / name


def check_record(config, files_and_scales):
    adapters = config["stage2"]["adapters"]
    assert [(a["file"], a["scale"], a["transformer"]) for a in adapters] == files_and_scales
    assert all(re.fullmatch(r"[0-9a-f]{64}", a["sha256"]) for a in adapters)


# Against the pipelines -----------------------------------------------------------------------------------


def test_cogvideox_two_adapters_with_scales_vs_pipeline(tmp_path):
    """A diffusers-format adapter at 0.7 and an older-format one at -0.4, as set_adapters weighs them."""
    first = diffusers_file(tmp_path, "style.safetensors", "tiny-cogvideox", seed=1)
    second = community_file(tmp_path, "old_keys.safetensors", "tiny-cogvideox", seed=2)
    flags = ["--lora", f"{first}:0.7", "--lora", f"{second}:-0.4"]
    latents, config = staged(tmp_path / "run", "tiny-cogvideox", stage2_flags=flags)
    check_record(config, [("style.safetensors", 0.7, "transformer"), ("old_keys.safetensors", -0.4, "transformer")])
    pipe = pipeline("tiny-cogvideox")
    base = pipeline_latents(pipe, config)
    pipe.load_lora_weights(first, adapter_name="style")  # not one-letter names: diffusers finds those in any key
    pipe.load_lora_weights(second, adapter_name="old_keys")
    pipe.set_adapters(["style", "old_keys"], [0.7, -0.4])
    expected = pipeline_latents(pipe, config)
    assert relative_error(latents, expected) <= TOLERANCE
    assert relative_error(latents, base) > 100 * TOLERANCE  # the adapters change the result


def test_wan22_few_step_recipe_one_adapter_per_expert_vs_pipeline(tmp_path):
    """The distillation recipe at tiny size: 4 Euler steps at shift 5, guidance 1 (no CFG, so the default
    mesh has no dp and uses all 8 devices), a diffusers-format adapter on the high-noise expert and an
    original-Wan-format one on the low-noise expert."""
    high = diffusers_file(tmp_path, "high_noise.safetensors", "tiny-wan2.2", seed=3)
    low = community_file(tmp_path, "low_noise.safetensors", "tiny-wan2.2", seed=4)
    recipe = ["--num_inference_steps", 4, "--scheduler", "euler", "--flow_shift", 5.0]
    latents, config = staged(
        tmp_path / "run", "tiny-wan2.2", recipe, ["--lora", high, "--lora_2", low], guidance_scale=1.0
    )
    stage2 = config["stage2"]
    check_record(
        config, [("high_noise.safetensors", 1.0, "transformer"), ("low_noise.safetensors", 1.0, "transformer_2")]
    )
    assert stage2["scheduler"] == "FlowMatchEulerDiscreteScheduler" and not stage2["classifier_free_guidance"]
    assert stage2["mesh"]["dp"] == 1 and stage2["mesh"]["sp"] * stage2["mesh"]["tp"] == 8
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = pipeline("tiny-wan2.2")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=5.0)
    pipe.load_lora_weights(high)
    pipe.load_lora_weights(low, load_into_transformer_2=True)
    assert relative_error(latents, pipeline_latents(pipe, config, guidance_scale=1.0)) <= TOLERANCE


def test_wan22_adapter_on_the_low_noise_expert_only_splash_on_a_mesh(tmp_path):
    """`--lora_2` alone, with CFG, Splash on a 2x2x2 dp/sp/tp mesh of CPU devices."""
    low = diffusers_file(tmp_path, "low.safetensors", "tiny-wan2.2", seed=5)
    mesh = ["--attention", "splash", "--dp", 2, "--sp", 2, "--tp", 2]
    latents, config = staged(tmp_path / "run", "tiny-wan2.2", stage2_flags=["--lora_2", f"{low}:1.5", *mesh])
    check_record(config, [("low.safetensors", 1.5, "transformer_2")])
    assert config["stage2"]["attention"] == "splash"
    pipe = pipeline("tiny-wan2.2")
    pipe.load_lora_weights(low, load_into_transformer_2=True, adapter_name="low")
    pipe.transformer_2.set_adapters(["low"], [1.5])
    assert relative_error(latents, pipeline_latents(pipe, config)) <= TOLERANCE


def test_wan_text_to_video_adapter_on_an_image_to_video_model(tmp_path):
    """diffusers expands a T2V adapter for an I2V transformer (zero image-projection weights); so do we."""
    image = tmp_path / "first.png"
    Image.new("RGB", (48, 32), (200, 80, 30)).save(image)
    adapter = diffusers_file(tmp_path, "t2v.safetensors", "tiny-wan2.1", seed=6)
    latents, config = staged(tmp_path / "run", "tiny-wan2.1-i2v", ["--image", image], ["--lora", adapter])
    pipe = pipeline("tiny-wan2.1-i2v")
    pipe.load_lora_weights(adapter)
    assert relative_error(latents, pipeline_latents(pipe, config, image=Image.open(image).convert("RGB"))) <= TOLERANCE


def test_hunyuanvideo15_adapter_vs_transformer_load_lora_adapter(tmp_path):
    """No pipeline loader exists for 1.5: the reference's transformer loads the file the model's own way
    (bare PEFT keys and the adapter's metadata, alpha 2x the rank, as save_lora_adapter writes them)."""
    _, transformer = peft_weights("tiny-hunyuanvideo15", seed=7, alpha=8)
    transformer.save_lora_adapter(tmp_path, weight_name="hy.safetensors")
    adapter = tmp_path / "hy.safetensors"
    latents, config = staged(tmp_path / "run", "tiny-hunyuanvideo15", stage2_flags=["--lora", f"{adapter}:0.8"])
    check_record(config, [("hy.safetensors", 0.8, "transformer")])
    pipe = pipeline("tiny-hunyuanvideo15")
    # use_safetensors=True: without it, diffusers 0.42.1 reads a file path through its pickle-era branch,
    # which drops the adapter's metadata (lora_alpha 8 becomes the rank, 4); the pipeline loaders pass it.
    pipe.transformer.load_lora_adapter(adapter, prefix=None, adapter_name="hy", use_safetensors=True)
    pipe.transformer.set_adapters(["hy"], [0.8])
    assert relative_error(latents, pipeline_latents(pipe, config)) <= TOLERANCE


# Runs that must not mix adapters ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """Stage 1 of tiny Wan 2.1 and two adapters for it."""
    folder = tmp_path_factory.mktemp("wan")
    flags = [f"--{key}={value}" for key, value in PIPELINE_REQUEST.items()]
    run_stage(
        stage1_text_encoder, ["--model", "tiny-wan2.1", "--prompt", PROMPT, "--output_dir", folder / "run", *flags]
    )
    adapters = [diffusers_file(folder, f"a{seed}.safetensors", "tiny-wan2.1", seed) for seed in (8, 9)]
    return folder / "run", adapters


def test_resume_with_other_adapters_is_refused(capsys, monkeypatch, wan_run):
    out, (first, second) = wan_run
    stop_stage2_after(monkeypatch, ["--input_dir", out, "--lora", first], steps=1)
    expect_user_error(
        capsys, stage2_transformer, ["--input_dir", out, "--resume", "--lora", second], "different request"
    )
    expect_user_error(capsys, stage2_transformer, ["--input_dir", out, "--resume"], "different request")


def test_magcache_ratios_calibrated_without_the_adapter_are_refused(capsys, tmp_path, wan_run):
    out, (first, _) = wan_run
    ratios = tmp_path / "mag_ratios.json"
    ratios.write_text(json.dumps({"model": "tiny-wan2.1", "mag_ratios": {"transformer.batch": [1.0] * 4}}))
    flags = ["--input_dir", out, "--cache", "magcache", "--cache_mag_ratios", ratios, "--lora", first]
    expect_user_error(capsys, stage2_transformer, flags, "calibrated with no LoRA adapter")


# Bad adapters: one error line before anything loads, the folder untouched ----------------------------------


def folder_bytes(folder):
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def bad_adapters(folder):
    """(name, flags, message) for each refusal; files made in `folder`."""
    from safetensors.torch import save_file

    good = diffusers_file(folder, "good.safetensors", "tiny-wan2.1", seed=10)
    (folder / "notes.safetensors").write_text("not a safetensors file")
    (folder / "notes.txt").write_bytes(good.read_bytes())
    (folder / "cut.safetensors").write_bytes(good.read_bytes()[:-64])
    cog = diffusers_file(folder, "cog.safetensors", "tiny-cogvideox", seed=11)
    wide = {
        key: torch.zeros(4, 2 * t.shape[1]) if "lora_A" in key else t
        for key, t in peft_weights("tiny-wan2.1", 12)[0].items()
    }
    save_file({f"transformer.{key}": t.contiguous() for key, t in wide.items()}, folder / "wide.safetensors")
    (folder / "two").mkdir()
    for name in ("x.safetensors", "y.safetensors"):
        (folder / "two" / name).write_bytes(good.read_bytes())
    original = community_file(folder, "original.safetensors", "tiny-wan2.1", seed=13)
    return [
        *malformed_adapters(folder, good, original),
        ("not-safetensors", ["--lora", folder / "notes.safetensors"], "not a readable .safetensors file"),
        ("truncated", ["--lora", folder / "cut.safetensors"], "not a readable .safetensors file"),
        ("other-family", ["--lora", cog], "(cogvideox)"),
        ("shape", ["--lora", folder / "wide.safetensors"], "does not fit the adapter's lora_A (4, "),
        ("lora_2-one-transformer", ["--lora_2", good], "has one transformer"),
        ("scale-nan", ["--lora", f"{good}:nan"], "is not a finite number"),
        ("scale-inf", ["--lora", f"{good}:1e999"], "is not a finite number"),
        ("two-files", ["--lora", folder / "two"], "holds 2 .safetensors files (x.safetensors, y.safetensors)"),
        ("missing", ["--lora", folder / "none.safetensors"], "no such file or folder"),
        ("not-suffix", ["--lora", folder / "notes.txt"], "notes.txt is not a .safetensors file"),
    ]


def rewritten(path, name: str, change=None, metadata=None):
    """A copy of the adapter file `path` with `change(tensors)` applied and/or its metadata replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        header = handle.metadata() or {}
    if change is not None:
        change(tensors)
    if metadata is not None:
        header = {**header, "lora_adapter_metadata": metadata}
    save_file(tensors, path.parent / name, metadata=header)
    return path.parent / name


def malformed_adapters(folder, good, original):
    """Files whose flaws diffusers' readers would only meet with a traceback, at load or fuse time."""
    first, block = "transformer.blocks.0.attn1.to_q", "diffusion_model.blocks.0.self_attn.q"
    from safetensors import safe_open

    with safe_open(str(good), "pt") as handle:
        config = json.loads(handle.metadata()["lora_adapter_metadata"])

    def edit(**values):
        return json.dumps({**config, **values})

    files = {
        "metadata-not-json": rewritten(good, "m1.safetensors", metadata="{not json"),
        "metadata-rank": rewritten(good, "m2.safetensors", metadata=edit(**{"transformer.r": 8})),
        "metadata-prefix": rewritten(good, "m3.safetensors", metadata=json.dumps({"r": 4, "lora_alpha": 4})),
        "metadata-nan": rewritten(good, "m4.safetensors", metadata=edit(**{"transformer.lora_alpha": float("nan")})),
        "one-d": rewritten(good, "d1.safetensors", lambda t: t.update({f"{first}.lora_A.weight": torch.zeros(4)})),
        "bias": rewritten(good, "b1.safetensors", lambda t: t.update({f"{first}.lora_B.bias": torch.zeros(3)})),
        "nan": rewritten(good, "n1.safetensors", lambda t: t[f"{first}.lora_B.weight"].fill_(float("nan"))),
        "wan-no-up": rewritten(original, "w1.safetensors", lambda t: t.pop(next(k for k in t if "lora_up" in k))),
        "wan-alpha-inf": rewritten(
            original, "w2.safetensors", lambda t: t.update({k: torch.tensor(float("inf")) for k in t if "alpha" in k})
        ),
        "wan-diff_b": rewritten(original, "w3.safetensors", lambda t: t.update({f"{block}.diff_b": torch.ones(5)})),
    }
    messages = {
        "metadata-not-json": "its lora_adapter_metadata is not JSON",
        "metadata-rank": "its metadata says rank 8, but blocks.0.attn1.to_k",
        "metadata-prefix": "its metadata names nothing of the 'transformer.'",
        "metadata-nan": "holds NaN or Infinity at transformer.lora_alpha",
        "one-d": "blocks.0.attn1.to_q.lora_A.weight is 1-D (4,); a Linear's LoRA weights are 2-D",
        "bias": "blocks.0.attn1.to_q.lora_B.bias is (3,); the layer has",
        "nan": f"{first}.lora_B.weight holds NaN or Inf",
        "wan-no-up": "diffusers' WanLoraLoaderMixin cannot read it (KeyError",
        "wan-alpha-inf": "alpha holds NaN or Inf",
        "wan-diff_b": "blocks.0.attn1.to_q.lora_B.bias is (5,); the layer has",
    }
    return [(name, ["--lora", path], messages[name]) for name, path in files.items()]


def test_bad_adapters_are_refused_before_loading_with_the_folder_untouched(capsys, tmp_path, wan_run):
    out, _ = wan_run
    before = folder_bytes(out)
    for name, flags, message in bad_adapters(tmp_path):
        expect_user_error(capsys, stage2_transformer, ["--input_dir", out, *flags], message)
        assert folder_bytes(out) == before, name


def test_adapter_files_resolve_from_folders_and_the_hub_cache(tmp_path, monkeypatch):
    """A folder holding one file; a hub id, and a hub id with a file name, from huggingface_hub's cache."""
    from huggingface_hub import constants

    from tpu_video.engine.lora import parse_flag, resolve_file

    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("0" * 40)
    (snapshot / "lora.safetensors").write_bytes(b"{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_file("org/name", "--lora").resolve() == (snapshot / "lora.safetensors").resolve()
    assert resolve_file("org/name/lora.safetensors", "--lora").resolve() == (snapshot / "lora.safetensors").resolve()
    assert resolve_file(str(snapshot), "--lora") == snapshot / "lora.safetensors"
    assert parse_flag("org/name:-0.4", "--lora") == ("org/name", -0.4)
    assert parse_flag("C:/adapters/a.safetensors", "--lora") == ("C:/adapters/a.safetensors", 1.0)


def test_flow_shift_override_reaches_flow_match_euler():
    """FlowMatchEuler keeps its shift from construction (register_to_config afterwards leaves the old one):
    the override must build the scheduler with it, as the HunyuanVideo-1.5 folder's and --scheduler euler do."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from tpu_video.models.common import flow_scheduler

    for preset, name in (("tiny-hunyuanvideo15", None), ("tiny-wan2.1", "euler")):
        source, _ = models.resolve_model(preset)
        ours, expected = flow_scheduler(source, 9.0, name), FlowMatchEulerDiscreteScheduler(shift=9.0)
        ours.set_timesteps(4), expected.set_timesteps(4)
        assert torch.equal(ours.timesteps, expected.timesteps)


def test_config_records_the_scheduler_and_other_families_refuse_it(capsys, tmp_path):
    argv = ["--model", "tiny-cogvideox", "--prompt", PROMPT, "--output_dir", tmp_path, "--scheduler", "euler"]
    expect_user_error(capsys, stage1_text_encoder, argv, "--scheduler is an option of wan")
    assert not (tmp_path / CONFIG_FILE).exists()


def test_plan_with_adapters_checks_them_and_compiles_the_same_program(tmp_path):
    """Adapters are fused before placement, so `--plan` compiles the base model's step: memory, collectives
    and FLOPs equal the plan without them, and the report lists what would be fused."""
    high = diffusers_file(tmp_path, "high.safetensors", "tiny-wan2.2", seed=13)
    low = community_file(tmp_path, "low.safetensors", "tiny-wan2.2", seed=14)
    reports = []
    for flags in ([], ["--lora", high, "--lora_2", f"{low}:0.5"]):
        out = tmp_path / f"plan{len(flags)}.json"
        argv = ["--input_dir", tmp_path / "none", "--model", "tiny-wan2.2", "--plan", "v6e-8", "--plan_json", out]
        run_stage(stage2_transformer, [*argv, *flags])
        reports.append(json.loads(out.read_text()))
    base, fused = reports
    assert [(a["file"], a["scale"], a["transformer"]) for a in fused["adapters"]["fused"]] == [
        ("high.safetensors", 1.0, "transformer"),
        ("low.safetensors", 0.5, "transformer_2"),
    ]
    assert "adapters" not in base and "fused into the weights" in fused["adapters"]["effect"]
    for key in ("hbm_bytes_per_device", "collectives", "flops_per_device", "mesh"):
        assert fused[key] == base[key], key
