"""LTX-2 (tpu_video/models/ltx2): the three stages on the tiny presets against diffusers' LTX2Pipeline run eagerly on
the same components, loaded from the same folder.

Tolerances, fp32, relative (Frobenius): stage 2's video and audio latents against the pipeline's
`output_type="latent"` 1e-5 (measured 4e-7 to 8e-7: the same operations, XLA's rounding), the decoded
frames and the waveform against the pipeline's decode 1e-5. The patched transformer against the stock one in
eager PyTorch: 1e-6 (measured: bit-identical), except a prompt row with no valid token, 3e-5 (measured up to
1.9e-5: the stock forward scores such a row's keys `score - 10000` in fp32). Cases: LTX-2.0's
defaults (CFG, modality guidance and rescale; its STG pass skipped, and recorded), LTX-2.3 with all four
passes (an STG block that acts) with Splash on a sequence- and tensor-split mesh and on the default mesh
(the passes on dp 4), CFG alone (dp 2), and each term turned off. Its plans for a TPU: tests/test_ltx2_plan.py.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import (
    dequantized,
    diffusers_file,
    enhancer_calls,
    expect_user_error,
    peft_weights,
    pipeline,
    relative_error,
    run_script,
    run_stage,
    write_image,
)
from helpers import (
    ltx2_reference as reference,
)
from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.models.ltx2 import guidance as ltx2_guidance
from tpu_video.models.ltx2 import transformer as ltx2_transformer
from tpu_video.models.ltx2.presets import tiny_transformer
from utils import Request, read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS = "a robot dancing", "blurry", 7, 4
OFF = {"stg_scale": 0.0, "audio_stg_scale": 0.0}
NO_CFG = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0}
NO_MODALITY = {"modality_scale": 1.0, "audio_modality_scale": 1.0}
NO_RESCALE = {"guidance_rescale": 0.0, "audio_guidance_rescale": 0.0}
# case: (preset, stage-2 flags, the pipeline's arguments for the same request, the branches stage 2 records)
CASES = {
    "ltx2.0-defaults": ("tiny-ltx2", [], {}, ["uncond", "cond", "isolated"]),
    "ltx2.3-every-term-splash": (
        "tiny-ltx2.3",
        ["--stg_blocks", "1", "--attention", "splash", "--sp", "2", "--tp", "4"],
        {"spatio_temporal_guidance_blocks": [1]},
        ["uncond", "cond", "stg", "isolated"],
    ),
    "ltx2.3-no-cfg": ("tiny-ltx2.3", ["--stg_blocks", "1"], {**NO_CFG, "spatio_temporal_guidance_blocks": [1]}, None),
    "ltx2.3-every-term-default-mesh": (
        "tiny-ltx2.3",
        ["--stg_blocks", "1"],
        {"spatio_temporal_guidance_blocks": [1]},
        None,
    ),
    "ltx2.3-cfg-only": ("tiny-ltx2.3", [], {**OFF, **NO_MODALITY}, ["uncond", "cond"]),
    "ltx2.3-no-modality": (
        "tiny-ltx2.3",
        ["--stg_blocks", "1"],
        {**NO_MODALITY, "spatio_temporal_guidance_blocks": [1]},
        None,
    ),
    "ltx2.3-no-guidance": ("tiny-ltx2.3", [], {**NO_CFG, **OFF, **NO_MODALITY, **NO_RESCALE}, ["cond"]),
}


def flags(arguments: dict) -> list[str]:
    """The stage-2 flags for the pipeline arguments that are request flags (the STG blocks are given apart)."""
    return [
        item
        for key, value in arguments.items()
        if key in {option.name for option in models.ltx2.OPTIONS} or key == "guidance_scale"
        for item in (f"--{key}", str(value))
    ]


@pytest.fixture(scope="module")
def stage1_folders(tmp_path_factory):
    """Stage 1 of each preset in fp32 (both stage-1 outputs are reused by every case)."""
    base = tmp_path_factory.mktemp("ltx2")
    folders = {}
    for preset in ("tiny-ltx2", "tiny-ltx2.3"):
        out = base / preset
        argv = ["--model", preset, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
        run_stage(stage1_text_encoder, [*argv, "--seed", SEED, "--num_inference_steps", STEPS, "--output_dir", out])
        folders[preset] = out
    return folders


@pytest.mark.parametrize("case", CASES)
def test_stage2_matches_the_pipeline(tmp_path, stage1_folders, case):
    preset, stage2_flags, arguments, branches = CASES[case]
    out = tmp_path / "run"
    shutil.copytree(stage1_folders[preset], out)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2_flags, *flags(arguments)])
    config = read_config(out, needs="stage2")
    tensors = read_tensors(out, config["stage2"])
    video, audio = reference(preset, config, "latent", **arguments)
    assert tensors["latents"].shape == video.shape and tensors["audio_latents"].shape == audio.shape
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    record = config["stage2"]["guidance"]
    if branches is not None:
        assert record["branches"] == branches
    if "--sp" not in stage2_flags:  # the default mesh: dp takes the passes where their count divides the 8 devices
        assert config["stage2"]["mesh"]["dp"] == math.gcd(len(record["branches"]), 8)
    # --scan_blocks auto: the blocks run as one scan, the STG blocks' perturbation mask a per-block input
    assert config["stage2"]["scan_blocks"]["scanned"]["transformer"] == [0, 2]
    if preset == "tiny-ltx2" and not stage2_flags:  # LTX-2.0 has no perturbed attention: skipped, and said so
        assert "perturbed attention" in record["skipped"]["stg"]


def test_one_device_and_the_decode_match_the_pipeline(tmp_path, stage1_folders):
    """Stage 2 in a process of one CPU device, then stage 3 (torch) against the pipeline's decode; the mp4
    holds one H.264 stream and one AAC stereo stream of the video's length, whose samples follow the
    vocoder's waveform."""
    import imageio_ffmpeg

    out = tmp_path / "run"
    shutil.copytree(stage1_folders["tiny-ltx2"], out)
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = run_script("stage2_transformer.py", ["--input_dir", out, "--executables", "off"], env_overrides=one)
    assert done.returncode == 0, done.stderr[-2000:]
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    assert config["stage2"]["device_count"] == 1
    stage2 = read_tensors(out, config["stage2"])
    saved = read_tensors(out, config["stage3"]["frames_file"])
    video, audio = reference("tiny-ltx2", config, "latent")
    assert relative_error(stage2["latents"], video) <= TOLERANCE
    assert relative_error(stage2["audio_latents"], audio) <= TOLERANCE
    frames, waveform = reference("tiny-ltx2", config, "np")
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE

    ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    probe = subprocess.run([ffmpeg, "-i", out / "output_video.mp4"], capture_output=True, text=True).stderr
    streams = re.findall(r"Stream #0:\d.*?: (Video|Audio): (\w+)", probe)
    assert streams == [("Video", "h264"), ("Audio", "aac")], probe
    rate = config["stage3"]["audio"]["sample_rate"]
    assert f"{rate} Hz, stereo" in probe
    pcm = subprocess.run(
        [ffmpeg, "-v", "error", "-i", out / "output_video.mp4", "-map", "0:a", "-f", "f32le", "-ac", "2", "-"],
        capture_output=True,
        check=True,
    ).stdout
    decoded = np.frombuffer(pcm, dtype="<f4").reshape(-1, 2).T
    expected = saved["waveform"].numpy()
    seconds = config["num_frames"] / config["fps"]
    assert abs(decoded.shape[1] / rate - seconds) <= 0.1, (decoded.shape, rate, seconds)
    length = min(decoded.shape[1], expected.shape[1])
    correlation = np.corrcoef(decoded[:, :length].ravel(), expected[:, :length].ravel())[0, 1]
    assert correlation >= 0.9, correlation


def test_adapters_fuse_as_the_pipeline_loads_them(tmp_path, stage1_folders):
    """`--lora` on LTX-2.3 with every guidance pass: a diffusers-format adapter at 0.8 and one in the original
    LTX-2 format (`diffusion_model.` keys, which LTX2LoraLoaderMixin converts) at -0.5, on both streams'
    self- and text attention, the audio<->video attentions and both feed-forwards. Stage 2 fuses them into
    the weights; the pipeline keeps them as PEFT layers."""
    from safetensors.torch import save_file

    first = diffusers_file(tmp_path, "style.safetensors", "tiny-ltx2.3", seed=1)
    weights, _ = peft_weights("tiny-ltx2.3", seed=2)
    second = tmp_path / "original.safetensors"
    save_file({f"diffusion_model.{key}": tensor.contiguous() for key, tensor in weights.items()}, second)
    out = tmp_path / "run"
    shutil.copytree(stage1_folders["tiny-ltx2.3"], out)
    adapters = ["--lora", f"{first}:0.8", "--lora", f"{second}:-0.5"]
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", "--stg_blocks", "1", *adapters])
    config = read_config(out, needs="stage2")
    assert [(a["file"], a["scale"]) for a in config["stage2"]["adapters"]] == [
        ("style.safetensors", 0.8),
        ("original.safetensors", -0.5),
    ]
    tensors = read_tensors(out, config["stage2"])
    arguments = {"spatio_temporal_guidance_blocks": [1]}
    video, audio = reference("tiny-ltx2.3", config, "latent", adapters=[(first, 0.8), (second, -0.5)], **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    base_video, base_audio = reference("tiny-ltx2.3", config, "latent", **arguments)
    assert relative_error(video, base_video) > 100 * TOLERANCE  # the adapters change both streams
    assert relative_error(audio, base_audio) > 100 * TOLERANCE


# The connectors' input projection and both connectors' attention and feed-forward (PEFT full-match regexes).
CONNECTOR_BLOCKS = r"(video|audio)_connector\.transformer_blocks\.\d+\."
CONNECTOR_TARGETS = rf"text_proj_in|{CONNECTOR_BLOCKS}(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"


def connectors_adapter(folder, preset: str, seed: int):
    """A random adapter for the transformer and the text connectors (diffusers' keys `transformer.*` and
    `connectors.*`, which LTX2LoraLoaderMixin loads into each; no metadata: the ranks come from the tensors)."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    weights, _ = peft_weights(preset, seed)
    connectors = models.resolve_model(preset)[0].load("connectors")
    torch.manual_seed(seed)
    connectors.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=CONNECTOR_TARGETS, init_lora_weights=False))
    with torch.no_grad():  # a modest change, as peft_weights keeps the transformer's
        for name, parameter in connectors.named_parameters():
            if "lora_" in name:
                parameter.mul_(0.5)
    tensors = {f"transformer.{key}": value for key, value in weights.items()}
    tensors.update({f"connectors.{key}": value for key, value in get_peft_model_state_dict(connectors).items()})
    save_file({key: value.contiguous() for key, value in tensors.items()}, folder / "both.safetensors")
    return folder / "both.safetensors"


def test_adapters_on_the_text_connectors_fuse_in_stage1_as_the_pipeline_loads_them(tmp_path, stage1_folders, capsys):
    """An adapter for the transformer and the text connectors at 0.8: stage 1's `--lora` fuses the connectors'
    share (their outputs change), stage 2's the transformer's, and the latents are the pipeline's with the
    adapter loaded its own way. Each stage checks the other: stage 2 refuses the adapter at another scale or
    where stage 1 fused none of it, and without the adapter stage 1 fused."""
    file = connectors_adapter(tmp_path, "tiny-ltx2", seed=4)
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--lora", f"{file}:0.8", "--output_dir", out]
    run_stage(stage1_text_encoder, argv)
    stage1 = read_config(out, needs="stage1")["stage1"]
    assert [(a["file"], a["scale"], a["transformer"]) for a in stage1["adapters"]] == [(file.name, 0.8, "connectors")]
    base = read_tensors(stage1_folders["tiny-ltx2"], read_config(stage1_folders["tiny-ltx2"])["stage1"])
    adapted = read_tensors(out, stage1)
    for name in ("connector_prompt_embeds", "connector_audio_prompt_embeds"):
        assert relative_error(adapted[name], base[name]) > 100 * TOLERANCE, name

    expect_user_error(capsys, stage2_transformer, ["--input_dir", out], f"give stage 2 the same --lora {file.name}:0.8")
    argv = ["--input_dir", out, "--lora", f"{file}:0.5"]
    expect_user_error(capsys, stage2_transformer, argv, "and stage 1 fused them at scale 0.8")
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", "--lora", f"{file}:0.8"])
    config = read_config(out, needs="stage2")
    tensors = read_tensors(out, config["stage2"])
    video, audio = reference("tiny-ltx2", config, "latent", adapters=[(file, 0.8)])
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE


class IntervalReference:
    """The interval cache from its definition (docs/caching.md), as hooks on the eager pipeline's transformer
    blocks: on a cached step the deep blocks (all but the first and the last) are replaced by their input
    plus the residual each stream kept from the last full step. Each of the pipeline's transformer calls per
    step (the CFG pair, the STG pass, the modality pass) keeps its own, as each of our batch's rows does."""

    def __init__(self, transformer, full_steps: set[int], calls_per_step: int) -> None:
        blocks = transformer.transformer_blocks
        self.first, self.last = 1, len(blocks) - 2
        self.full_steps, self.calls_per_step = full_steps, calls_per_step
        self.calls, self.entry, self.residuals = -1, None, {}
        transformer.register_forward_pre_hook(self.count)
        for index in range(self.first, self.last + 1):
            blocks[index].forward = functools.partial(self.block, index, blocks[index].forward)

    def count(self, module, args) -> None:
        self.calls += 1

    def block(self, index, forward, **kwargs):
        step, call = divmod(self.calls, self.calls_per_step)
        video, audio = kwargs["hidden_states"], kwargs["audio_hidden_states"]
        if step not in self.full_steps:
            if index == self.first:
                kept = self.residuals[call]
                return video + kept[0], audio + kept[1]
            return video, audio
        if index == self.first:
            self.entry = (video, audio)
        output = forward(**kwargs)
        if index == self.last:
            self.residuals[call] = (output[0] - self.entry[0], output[1] - self.entry[1])
        return output


@pytest.mark.parametrize("stg", [True, False], ids=["four-passes-scanned", "three-passes-unscanned-keyframe"])
def test_interval_cache_equals_its_definition_on_both_streams(tmp_path, four_block_ltx2, stg):
    """`--cache interval` on a 4-block LTX-2.3 on the default mesh: steps 2 and 3 of 6 run only the outer
    blocks and reuse the deep blocks' video and audio residuals; within 1e-5 of IntervalReference on the
    eager pipeline. With all four passes (dp 4) the two deep blocks run as one scan, the STG pass perturbing
    the first of them; without STG (three passes) they run unscanned (`--scan_blocks off`), and the video has a
    keyframe at its last latent frame (`--condition`: its tokens after the video's, in the residual too; against
    LTX2ConditionPipeline with the same hooks)."""
    from diffusers import LTX2ConditionPipeline, LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from PIL import Image

    folder = four_block_ltx2
    out = tmp_path / "run"
    argv = ["--model", folder, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--height", 64, "--width", 64, "--num_frames", 9, "--seed", SEED, "--num_inference_steps", 6]
    keyframe = None if stg else write_image(tmp_path / "keyframe.png", 40, 52)
    conditioned = [] if stg else ["--condition", keyframe, "--condition_index", -1, "--image_crf", 0]
    run_stage(stage1_text_encoder, [*argv, *conditioned, "--output_dir", out])
    window = ["--cache_start_step", 1, "--cache_end_step", 5, "--cache_step_interval", 3]
    terms = ["--stg_blocks", "1"] if stg else ["--stg_scale", 0, "--audio_stg_scale", 0, "--scan_blocks", "off"]
    argv = ["--input_dir", out, "--executables", "off", *terms, "--cache", "interval", *window]
    run_stage(stage2_transformer, argv)
    config = read_config(out, needs="stage2")
    assert config["stage2"]["step_cache"]["schedule"] == "FFCCFF"
    assert config["stage2"]["mesh"]["dp"] == (4 if stg else 1)
    assert config["stage2"]["scan_blocks"]["scanned"]["transformer"] == ([1, 3] if stg else None)
    tensors = read_tensors(out, config["stage2"])
    arguments = {"spatio_temporal_guidance_blocks": [1]} if stg else dict(OFF)
    if not stg:
        frames = Image.open(keyframe).convert("RGB")
        arguments["conditions"] = [LTX2VideoCondition(frames=frames, index=-1, strength=1.0, crf=0)]
    cls = LTX2Pipeline if stg else LTX2ConditionPipeline
    pipe = cls.from_pretrained(folder, dtype=torch.float32)
    IntervalReference(pipe.transformer, full_steps={0, 1, 4, 5}, calls_per_step=3 if stg else 2)
    video, audio = reference(pipe, config, "latent", **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    uncached = reference(cls.from_pretrained(folder, dtype=torch.float32), config, "latent", **arguments)
    assert relative_error(video, uncached[0]) > 10 * TOLERANCE  # the cached steps change both streams
    assert relative_error(audio, uncached[1]) > 10 * TOLERANCE


def test_int8_weights_match_the_pipeline_with_the_same_dequantized_weights(tmp_path, stage1_folders):
    """`--quantize int8_weight` on LTX-2.3 with every pass: every linear of the blocks (six attentions with
    their gates, both feed-forwards) reads int8 weights with a float32 scale per output channel; the pipeline
    gets the same linears' weights replaced by those integers x scale."""
    out = tmp_path / "run"
    shutil.copytree(stage1_folders["tiny-ltx2.3"], out)
    argv = ["--input_dir", out, "--executables", "off", "--stg_blocks", "1", "--quantize", "int8_weight"]
    run_stage(stage2_transformer, argv)
    config = read_config(out, needs="stage2")
    tensors = read_tensors(out, config["stage2"])
    pipe = pipeline("tiny-ltx2.3")
    linears = [m for n, m in pipe.transformer.named_modules() if n.startswith("transformer_blocks.")]
    linears = [module for module in linears if isinstance(module, torch.nn.Linear)]
    for linear in linears:
        dequantized(linear, "int8_weight")
    assert len(linears) == 2 * 34  # 6 attentions x (q, k, v, out, gate) + 2 feed-forwards x 2, per block
    arguments = {"spatio_temporal_guidance_blocks": [1]}
    video, audio = reference(pipe, config, "latent", **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    unquantized = reference("tiny-ltx2.3", config, "latent", **arguments)
    assert relative_error(tensors["latents"], unquantized[0]) > 10 * relative_error(tensors["latents"], video)


def test_torchax_decode_matches_the_pipeline(tmp_path, stage1_folders):
    """Stage 3 with --backend torchax on the 8 devices: the video VAE as one program, the soundtrack (LTX-2.3's
    vocoder with its bandwidth extension) on the host, as the config records."""
    out = tmp_path / "run"
    shutil.copytree(stage1_folders["tiny-ltx2.3"], out)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off"])
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torchax", "--save_frames"])
    config = read_config(out, needs="stage3")
    saved = read_tensors(out, config["stage3"]["frames_file"])
    frames, waveform = reference("tiny-ltx2.3", config, "np")
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE
    assert (
        config["stage3"]["audio"]["decoded_on"] == "torch on cpu" and config["stage3"]["audio"]["sample_rate"] == 48000
    )


def test_a_stage2_folder_from_before_the_denormalization_fix_decodes_as_the_pipeline(
    tmp_path, stage1_folders, monkeypatch, capsys
):
    """A stage-2 section written before 2026-11-27, labelled {"method": "none"} without the mark: that stage 2
    read both VAEs' statistics as zeros and ones but kept the video VAE's scaling factor (0.8 here). Made here
    by today's stage 2 with exactly that: its latents are far from the pipeline's (so the parity tests catch a
    stage 2 that skips the statistics), and stage 3 de-normalises them, says so, and decodes the pipeline's
    frames and waveform (1e-5)."""
    from tpu_video.models.ltx2 import latents as ltx2_latents
    from tpu_video.models.ltx2 import pipeline as ltx2_pipeline

    out = tmp_path / "run"
    shutil.copytree(stage1_folders["tiny-ltx2"], out)
    read = ltx2_latents.latent_statistics

    def zeros_and_ones(source, component, planning=False):
        mean, std = read(source, component, planning)
        return torch.zeros_like(mean), torch.ones_like(std)

    monkeypatch.setattr(ltx2_latents, "latent_statistics", zeros_and_ones)
    monkeypatch.setattr(ltx2_pipeline, "latents_normalization", lambda source: {"method": "none"})
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off"])
    monkeypatch.undo()
    config = read_config(out, needs="stage2")
    assert config["stage2"]["latents_normalization"] == {"method": "none"}
    tensors = read_tensors(out, config["stage2"])
    video, audio = reference("tiny-ltx2", config, "latent")
    assert relative_error(tensors["latents"], video) > 0.1 and relative_error(tensors["audio_latents"], audio) > 0.1

    capsys.readouterr()
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    assert "predates 2026-11-27 and stored normalised LTX-2 latents" in capsys.readouterr().out
    config = read_config(out, needs="stage3")
    assert config["stage2"]["latents_normalization"] == {"method": "none"}  # stage 3 leaves stage 2's section
    saved = read_tensors(out, config["stage3"]["frames_file"])
    frames, waveform = reference("tiny-ltx2", config, "np")
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE


def test_the_presets_statistics_are_not_the_identity_and_key_their_folder():
    """Both VAEs' latent statistics and the scaling factor are not 0, 1 and 1 (de-normalising would be the
    identity and hide a decode that skips it), and the preset's cached folder is keyed by its tensors, not only
    its configs: a preset whose statistics change gets a new folder instead of the stale one."""
    import dataclasses

    preset = models.PRESETS["tiny-ltx2"]
    pipe = preset.build()
    for vae in (pipe.vae, pipe.audio_vae):
        assert (vae.latents_mean.abs() > 1e-3).all() and ((vae.latents_std - 1).abs() > 1e-3).all()
    assert pipe.vae.config.scaling_factor != 1.0
    before = models.materialize_preset("tiny-ltx2")

    def doubled_std():
        changed = preset.build()
        changed.vae.latents_std.mul_(2)
        return changed

    models.PRESETS["tiny-ltx2"] = dataclasses.replace(preset, build=doubled_std)
    try:
        after = models.materialize_preset("tiny-ltx2")
    finally:
        models.PRESETS["tiny-ltx2"] = preset
    assert after != before  # the configs are the same; only a buffer differs


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_the_jit_safe_transformer_is_the_stock_one_in_eager(version):
    """make_jit_safe's patches (RoPE tables fed in, boolean text masks, per-branch modality factors, no
    value test on the perturbation mask) on a batch of [uncond, cond, stg, isolated]-like rows."""
    stock, patched = tiny_transformer(4, version), tiny_transformer(4, version)
    inputs = ltx2_transformer.make_jit_safe(patched)
    assert ltx2_transformer.make_jit_safe(patched) is inputs  # patched once
    generator = torch.Generator().manual_seed(0)
    video = torch.randn(3, 48, 8, generator=generator)
    audio = torch.randn(3, 9, 4, generator=generator)
    width = 16 if version == "2.0" else 64
    text = torch.randn(3, 16, width, generator=generator)
    audio_text = torch.randn(3, 16, 16 if version == "2.0" else 32, generator=generator)
    mask = torch.ones(3, 16, dtype=torch.int64)
    mask[0, :11] = 0  # a left-padded prompt
    mask[1] = 0  # no valid token: the stock bias is uniform over the keys, so every key counts
    video_coords = stock.rope.prepare_video_coords(1, 3, 4, 4, "cpu", fps=24.0)
    audio_coords = stock.audio_rope.prepare_audio_coords(1, 9, "cpu")
    common = {
        "hidden_states": video,
        "audio_hidden_states": audio,
        "encoder_hidden_states": text,
        "audio_encoder_hidden_states": audio_text[..., : 16 if version == "2.0" else 32],
        "timestep": torch.full((3,), 700.0),
        "sigma": torch.full((3,), 700.0),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,
        "use_cross_timestep": True,
        "return_dict": False,
    }
    stg = {"spatio_temporal_guidance_blocks": [1], "perturbation_mask": torch.tensor([1.0, 0.0, 1.0])}
    if version == "2.0":
        stg = {}
    coords = {"video_coords": video_coords.repeat(3, 1, 1, 1), "audio_coords": audio_coords.repeat(3, 1, 1, 1)}
    with torch.no_grad():
        expected = stock(**common, **coords, **stg)
        inputs.tables = ltx2_transformer.rope_tables(stock, video_coords, audio_coords)
        got = patched(**common, **coords, **stg)
        isolated_expected = stock(**common, **coords, isolate_modalities=True)
        inputs.keep = torch.zeros(3)
        isolated = patched(**common, **coords)
    for actual, wanted in zip((*got, *isolated), (*expected, *isolated_expected), strict=True):
        assert relative_error(actual[0::2], wanted[0::2]) <= 1e-6
        # The row without a valid token: the stock forward scores every key `score - 10000` in fp32, which
        # keeps about three decimals of each score; the patched one scores them as they are.
        assert relative_error(actual[1], wanted[1]) <= 3e-5


def test_guidance_follows_the_pipeline_and_states_its_departures():
    config = dict(tiny_transformer(0, "2.3").config)
    base = {"model_family": "ltx2", "model_id": "tiny-ltx2.3", "prompt": "p", "negative_prompt": "", "dtype": "fp32"}
    base |= {"height": 64, "width": 64, "num_frames": 9, "fps": 24, "num_inference_steps": 4, "guidance_scale": 3.0}
    base |= {"seed": 0}
    defaults = ltx2_guidance.resolve_guidance(Request(**base), config)
    assert defaults.audio.cfg == 7.0 and defaults.video.cfg == 3.0
    assert defaults.branches == ("uncond", "cond", "isolated")  # the default STG block 28 is past 2 blocks
    assert "beyond" in defaults.skipped["stg"]
    zero = ltx2_guidance.resolve_guidance(Request(**base, options={"audio_guidance_scale": 0.0}), config)
    assert zero.audio.cfg == 0.0  # 0 means 0 (the pipeline's `or` would take the video's 3.0)
    with pytest.raises(UserError, match="blocks"):
        ltx2_guidance.resolve_guidance(Request(**base, options={"stg_blocks": "2"}), config)
    with pytest.raises(UserError, match="off"):
        ltx2_guidance.resolve_guidance(
            Request(**base, options={"stg_blocks": "1", "stg_scale": 0.0, "audio_stg_scale": 0.0}), config
        )


def test_stage2_and_stage3_refuse_what_ltx2_cannot_run(capsys, tmp_path, stage1_folders):
    """(Stage-1 bad input: tests/test_bad_inputs.py, cause "ltx2".)"""
    folder = tmp_path / "ltx2"
    shutil.copytree(stage1_folders["tiny-ltx2"], folder)
    run_stage(stage2_transformer, ["--input_dir", folder, "--executables", "off"])
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", folder, "--fps", "30"], "soundtrack")
    argv = ["--input_dir", folder, "--backend", "torchax", "--chunk_frames", 1]
    expect_user_error(capsys, stage3_vae_decoder, argv, "the ltx2 decode runs as one program (give 0 or leave it out)")
    argv = ["--input_dir", folder, "--cache", "magcache"]
    expect_user_error(capsys, stage2_transformer, argv, "--cache magcache: ltx2 runs --cache interval only")
    argv = ["--input_dir", folder, "--sigmas", "distilled_refine"]  # brings --noise_scale 0.909375
    message = "--sigmas distilled_refine (it sets --noise_scale 0.909375) acts only on a pass from given latents"
    expect_user_error(capsys, stage2_transformer, argv, message)
    # The step between passes (--upsample): its flags alone, its output folder, a wrong upsampler folder; the
    # checks come before any upsampler weights load, and nothing is written.
    up = tmp_path / "up"
    expect_user_error(capsys, stage2_transformer, ["--input_dir", folder, "--upsample"], "give --output_dir")
    argv = ["--input_dir", folder, "--adain_factor", "0.5"]
    expect_user_error(capsys, stage2_transformer, argv, "--adain_factor acts only with --upsample")
    argv = ["--input_dir", folder, "--upsample", "--output_dir", up, "--lora", "x.safetensors"]
    expect_user_error(capsys, stage2_transformer, argv, "--lora belongs to a denoise")
    argv = ["--input_dir", folder, "--upsample", "--output_dir", up, "--seed", "3"]  # the refine's flag
    expect_user_error(capsys, stage2_transformer, argv, "--seed belongs to a denoise (give it to the pass after it)")
    (tmp_path / "empty").mkdir()
    argv = ["--input_dir", folder, "--upsample", "--latent_upsampler", tmp_path / "empty", "--output_dir", up]
    expect_user_error(capsys, stage2_transformer, argv, "no LTX-2 latent upsampler in")
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    LTX2LatentUpsamplerModel(in_channels=4, mid_channels=32, num_blocks_per_stage=1).save_pretrained(tmp_path / "u4")
    argv = ["--input_dir", folder, "--upsample", "--latent_upsampler", tmp_path / "u4", "--output_dir", up]
    expect_user_error(capsys, stage2_transformer, argv, "takes 4 latent channels; this model's VAE makes 8")
    assert not up.exists()
    window = ["--cache_start_step", 1, "--cache_end_step", 4, "--cache_step_interval", 2]
    argv = ["--input_dir", folder, "--cache", "interval", *window]  # the tiny preset's 2 blocks
    expect_user_error(capsys, stage2_transformer, argv, "needs at least 3 transformer blocks")
    from safetensors.torch import save_file  # an adapter that also changes the text connectors (stage 1's)

    weights, _ = peft_weights("tiny-ltx2", seed=3)
    weights = {f"transformer.{key}": tensor.contiguous() for key, tensor in weights.items()}
    weights["connectors.text_proj_in.lora_A.weight"] = torch.zeros(4, 16)
    weights["connectors.text_proj_in.lora_B.weight"] = torch.zeros(16, 4)
    save_file(weights, tmp_path / "with_connectors.safetensors")
    argv = ["--input_dir", folder, "--lora", tmp_path / "with_connectors.safetensors"]
    expected = "2 of its weights adapt the text connectors, which stage 1 runs, and stage 1 fused none of them"
    expect_user_error(capsys, stage2_transformer, argv, expected)


def test_a_prompt_list_batches_each_video_as_the_pipeline_runs_it(monkeypatch, tmp_path):
    """Stage 1 `--prompts` (three entries with their own prompts, negative prompts and seeds) with
    `--enhance_prompt` (the text encoder rewrites each prompt, sampling seeded by the entry's seed, with the Gemma 3
    text-to-video instructions diffusers keeps), stage 2 in batches of 2 of LTX-2.3 with all four passes (8 rows
    per step; the second batch padded with a copy): each folder's video and audio latents within 1e-5 of the
    pipeline run for that entry alone with the same enhancement; stage 3 over the three folders (one soundtrack
    module, kept for all) gives the last one the pipeline's waveform."""
    from diffusers.pipelines.ltx2.utils import T2V_DEFAULT_SYSTEM_PROMPT

    from tpu_video.engine import batch_folders

    entries = [
        {"prompt": "a cat on a sofa", "seed": 3},
        {"prompt": "a dog in the rain", "negative_prompt": "blurry", "seed": 4},
        {"prompt": "a red kite", "negative_prompt": "dark", "seed": 11},
    ]
    listing = tmp_path / "list.jsonl"
    listing.write_text("\n".join(json.dumps(entry) for entry in entries) + "\n")
    calls = enhancer_calls(monkeypatch, "LTX2Pipeline")
    out = tmp_path / "batch"
    argv = ["--model", "tiny-ltx2.3", "--prompts", listing, "--dtype", "fp32", "--num_inference_steps", STEPS]
    run_stage(stage1_text_encoder, [*argv, "--enhance_prompt", "--output_dir", out])
    argv = ["--input_dir", out, "--executables", "off", "--stg_blocks", "1", "--batch_size", "2"]
    run_stage(stage2_transformer, argv)
    folders = batch_folders.expand_folders([str(out)])
    pipe = pipeline("tiny-ltx2.3")
    arguments = {"spatio_temporal_guidance_blocks": [1], "enable_prompt_enhancement": True}
    arguments["system_prompt"] = T2V_DEFAULT_SYSTEM_PROMPT
    enhanced = [read_config(folder)["stage1"]["enhanced_prompt"] for folder in folders]
    assert len(set(enhanced)) == 3 and not {entry["prompt"] for entry in entries} & set(enhanced)
    asked = [(call["prompt"], call["system_prompt"], call["seed"], call["text"]) for call in calls]
    told = [(entry["prompt"], T2V_DEFAULT_SYSTEM_PROMPT, entry["seed"]) for entry in entries]
    assert [ask[:3] for ask in asked] == told and [ask[3] for ask in asked] == [[text] for text in enhanced]
    assert all(call["image"] is None for call in calls)
    for number, folder in enumerate(folders):
        config = read_config(folder, needs="stage2")
        assert config["stage2"]["batch"]["size"] == 2 and len(config["stage2"]["guidance"]["branches"]) == 4
        tensors = read_tensors(folder, config["stage2"])
        video, audio = reference(pipe, config, "latent", **arguments)
        assert calls[-1] == calls[number], "the pipeline enhanced otherwise"
        assert relative_error(tensors["latents"], video) <= TOLERANCE, folder.name
        assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE, folder.name
    assert read_config(folders[2])["stage2"]["batch"]["padding"] == 1
    # Stage 3 over the three folders reuses one soundtrack module; the last folder's sound is still its own.
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--save_frames"])
    config = read_config(folders[2], needs="stage3")
    assert config["stage3"]["audio"]["decoded_on"] == "torch on cpu"
    saved = read_tensors(folders[2], config["stage3"]["frames_file"])
    frames, waveform = reference(pipe, config, "np", **arguments)
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE


def test_a_text_encoder_the_family_does_not_run_is_refused(capsys, tmp_path):
    """A folder whose model_index.json names another text encoder than Gemma 3 or Gemma 4 is named and refused
    before any weights load."""
    folder = tmp_path / "other-encoder"
    shutil.copytree(models.materialize_preset("tiny-ltx2"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "T5EncoderModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    argv = ["--model", folder, "--prompt", "p", "--output_dir", tmp_path / "out"]
    expect_user_error(capsys, stage1_text_encoder, argv, "has the text encoder T5EncoderModel; supported: LTX-2.0")


def test_the_enhancer_takes_the_pipelines_image_and_instructions_and_a_switch_is_a_boolean():
    """Which image the enhancer is shown (i2v's; else the first condition's first frame, as
    LTX2ConditionPipeline; else none), the instructions it gets by default (LTX-2.5's own for a folder with a
    dedicated enhancer, else diffusers' Gemma 3 ones), and a hand-edited switch that is not true or false."""
    from types import SimpleNamespace

    from diffusers.pipelines.ltx2 import utils as ltx2_utils

    from tpu_video.cli.options import Option
    from tpu_video.models.ltx2 import enhance

    first, second = object(), object()
    assert enhance.first_image({"image": first, "condition": [[second]]}) is first
    assert enhance.first_image({"condition": [[second, first], [first]]}) is second
    assert enhance.first_image({}) is None
    dedicated = SimpleNamespace(index={"prompt_enhancer": ["transformers", "Gemma4ForConditionalGeneration"]})
    plain = SimpleNamespace(index={"prompt_enhancer": [None, None]})
    assert enhance.default_system_prompt(dedicated, True) == ltx2_utils.LTX2_5_I2V_DEFAULT_SYSTEM_PROMPT
    assert enhance.default_system_prompt(dedicated, False) == ltx2_utils.LTX2_5_T2V_DEFAULT_SYSTEM_PROMPT
    assert enhance.default_system_prompt(plain, False) == ltx2_utils.T2V_DEFAULT_SYSTEM_PROMPT
    Option("enhance_prompt", "bool", "").check(True)
    with pytest.raises(UserError, match='enhance_prompt is "yes" in the request; it must be true or false'):
        Option("enhance_prompt", "bool", "").check("yes")
