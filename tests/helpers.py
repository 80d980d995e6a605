"""Shared test helpers: running a stage in-process or as a real subprocess, and comparing tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tpu_video.attention.reference import reference_attention  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[1]


def _float64(values) -> torch.Tensor:
    if torch.is_tensor(values):
        return values.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.array(values, dtype=np.float64))


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64."""
    actual, expected = _float64(actual), _float64(expected)
    return ((actual - expected).norm() / expected.norm()).item()


def run_stage(module, argv: list[str]) -> None:
    """Run a stage's main() in this process exactly as its `__main__` block does."""
    from tpu_video.cli import run_cli

    run_cli(lambda: module.main([str(arg) for arg in argv]))


def run_stages(steps: list[tuple[str, list]]) -> None:
    """Run (script file name, argv) pairs in this process, in order, as their command lines would."""
    import importlib

    for script, argv in steps:
        run_stage(importlib.import_module(Path(script).stem), argv)


def expect_user_error(capsys, module, argv: list[str], message: str) -> str:
    """Assert the stage exits with status 2 and one `error:` line containing `message`."""
    with pytest.raises(SystemExit) as exit_info:
        run_stage(module, argv)
    assert exit_info.value.code == 2
    said = capsys.readouterr().err.splitlines()
    err_lines = [line for line in said if line.startswith("error:")]
    assert len(err_lines) == 1, err_lines
    assert message in err_lines[0], err_lines[0]
    assert said[-1] == err_lines[0], f"the error is not one line: {said[said.index(err_lines[0]) :]}"
    return err_lines[0]


def run_script(
    script: str,
    argv: list[str],
    extra_pythonpath: Path | None = None,
    env_overrides: dict[str, str] | None = None,
    **kwargs,
):
    """Run a stage script as a real subprocess (the user's command line)."""
    env = {**os.environ, **(env_overrides or {})}
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / script), *[str(arg) for arg in argv]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        **kwargs,
    )


def three_stages(out: Path, stage1_argv: list, stage2_flags=()) -> tuple:
    """Stages 1 (`stage1_argv` plus --output_dir), 2 and 3 (--save_frames) in this process into `out`;
    (stage 2's latents, stage 3's float frames, the config)."""
    import stage1_text_encoder
    import stage2_transformer
    import stage3_vae_decoder
    from utils import read_config, read_tensors

    run_stage(stage1_text_encoder, [*stage1_argv, "--output_dir", out])
    run_stage(stage2_transformer, ["--input_dir", out, *stage2_flags])
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--save_frames"])
    config = read_config(out, needs="stage3")
    frames = read_tensors(out, config["stage3"]["frames_file"])["frames_float"]
    return read_tensors(out, config["stage2"])["latents"], frames, config


def write_image(path: Path, height: int, width: int, seed: int = 3) -> Path:
    """A random RGB image file (its format from the suffix), for image-to-video tests."""
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def read_mp4(path):
    """(metadata, frames as flat uint8 arrays) decoded back from an mp4 file with ffmpeg."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    frames = [np.frombuffer(frame, dtype=np.uint8) for frame in reader]
    return meta, frames


def tiny_stage1(out: Path, *flags) -> Path:
    """Stage 1 in this process on the tiny CogVideoX preset (fp32), into `out`; returns `out`."""
    import stage1_text_encoder

    argv = ["--model", "tiny-cogvideox", "--prompt", "a red cat", "--output_dir", out, "--dtype", "fp32", *flags]
    run_stage(stage1_text_encoder, argv)
    return out


# HunyuanVideo-1.5 transformer inputs shared by the patch, fused-attention and canary tests.
TEXT, BYT5, IMAGE = 12, 6, 5


def tiny_hunyuan_transformer():
    """A tiny HunyuanVideo-1.5 transformer for the forward-patch tests (seeded)."""
    from tpu_video.models import hunyuanvideo15

    return hunyuanvideo15.presets.tiny_transformer(seed=0)


class Sample(torch.nn.Module):
    """The transformer's output tensor, so jit sees no Python `return_dict` argument."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, **kwargs):
        return self.transformer(**kwargs, return_dict=False)[0]


def hunyuan_inputs(batch=2, seed=1):
    """Text masks with padding at the end, in the middle, and a row with no ByT5 text at all."""
    generator = torch.Generator().manual_seed(seed)
    text_mask = torch.ones(batch, TEXT, dtype=torch.int64)
    text_mask[0, 9:] = 0
    text_mask[-1, 3:5] = 0
    byt5_mask = torch.zeros(batch, BYT5, dtype=torch.int64)
    byt5_mask[0, :4] = 1
    return {
        "hidden_states": torch.randn(batch, 9, 3, 4, 6, generator=generator),
        "timestep": torch.tensor([700.0] * batch),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "encoder_attention_mask": text_mask,
        "encoder_hidden_states_2": torch.randn(batch, BYT5, 8, generator=generator),
        "encoder_attention_mask_2": byt5_mask,
        "image_embeds": torch.zeros(batch, IMAGE, 12),
    }


def collectives_in(jax_function, shapes, mesh, layout=("dp",)) -> list[str]:
    """The collective ops in `jax_function` compiled for inputs of `shapes` laid out as `layout` (default: the
    batch on `dp`)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_video.runtime import torchax_runtime

    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*layout))) for shape, dtype in shapes]
    with torchax_runtime.torchax.default_env():
        hlo = jax.jit(jax_function).lower(*args).compile().as_text()
    return [name for name in ("all-reduce", "all-gather", "collective-permute", "all-to-all") if f" {name}" in hlo]


def stop_stage2_after(monkeypatch, argv: list[str], steps: int, said: str | None = None) -> None:
    """Run stage 2 in this process and stop it after `steps` steps (counted over all its loops: Wan Animate's
    segments) as SIGTERM does (the guard saves a checkpoint, then raises Stopped, whose message holds `said`,
    by default "after step <steps> of"); the test then resumes it with --resume."""
    from tpu_video.cli import Stopped
    from tpu_video.engine.guard import DenoiseGuard

    after_step = DenoiseGuard.after_step
    done = []

    def stop_after(self, index, total, tensors, **kwargs):
        done.append(index)
        self.stop_requested = len(done) == steps
        return after_step(self, index, total, tensors, **kwargs)

    import stage2_transformer
    from tpu_video.cli import run_ended

    with monkeypatch.context() as patch:
        patch.setattr(DenoiseGuard, "after_step", stop_after)
        with pytest.raises(Stopped, match=said or f"after step {steps} of"):
            try:
                stage2_transformer.main([str(arg) for arg in argv])
            finally:
                run_ended()  # as run_cli: the folder held is let go


def attention_plan(backend: str, mesh=None, *, heads: int = 1, sp_mode: str = "auto", **splash_options):
    """A fixed AttentionPlan for `backend` on `mesh` (a jax Mesh or None), its scheme resolved for `heads`;
    Splash with 128 tiles in interpret mode (and `splash_options`)."""
    from tpu_video.attention.plan import SplashConfig, fixed_plan

    tiles = {"block_q": 128, "block_kv": 128, "block_kv_compute": 128, "interpret": True, **splash_options}
    splash = SplashConfig(**tiles) if backend == "splash" else None
    shape = None if mesh is None else dict(mesh.shape)
    return fixed_plan(backend, splash, mesh_shape=shape, heads=heads, sp_mode=sp_mode)


# A tiny preset staged and its own diffusers pipeline run eagerly on the same request --------------------

PROMPT, NEGATIVE = "a cat playing guitar", "blurry"
PIPELINE_REQUEST = {"num_inference_steps": 4, "seed": 7}  # sizes: each tiny preset's defaults (the config's)


def staged(out, preset, stage1_flags=(), stage2_flags=(), guidance_scale=5.0):
    """Stages 1 and 2 of `preset` in fp32 in this process, for PROMPT/NEGATIVE and PIPELINE_REQUEST: the final
    latents and the config."""
    import stage1_text_encoder
    import stage2_transformer
    from utils import read_config, read_tensors

    flags = [f"--{key}={value}" for key, value in PIPELINE_REQUEST.items()]
    argv = ["--model", preset, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32", *stage1_flags]
    run_stage(stage1_text_encoder, [*argv, "--guidance_scale", guidance_scale, "--output_dir", out, *flags])
    run_stage(stage2_transformer, ["--input_dir", out, *stage2_flags])
    config = read_config(out, needs="stage2")
    return read_tensors(out, config["stage2"])["latents"], config


def tiny_upsampler(folder, seed: int = 5):
    """A random x2 latent upsampler for the tiny VAE's 8 latent channels (other weights than the presets' own),
    saved as the published one is."""
    from tpu_video.models.ltx2.presets import tiny_upsampler as build

    model = build(seed)
    model.save_pretrained(folder)
    return model


def pipeline(preset: str):
    """The preset's diffusers pipeline, loaded from its materialized folder in fp32, with the preset's
    pipeline attributes (the padded lengths of models.family.Preset) as the stages use them."""

    import diffusers

    from tpu_video import models

    source, _ = models.resolve_model(preset)
    cls = getattr(diffusers, source.index["_class_name"])
    return source.configure(cls.from_pretrained(source.location, dtype=torch.float32))


def pipeline_latents(pipe, config, guidance_scale=5.0, **extra):
    """The pipeline's final latents for the request stage 1 recorded in `config`."""
    kwargs = {"guidance_scale": guidance_scale} if "guider" not in pipe.components else {}
    if "guider" in pipe.components:
        pipe.guider.guidance_scale = guidance_scale
    if "transformer_2" in pipe.components and pipe.transformer_2 is not None:
        kwargs["guidance_scale_2"] = guidance_scale
    if type(pipe).__name__.startswith("CogVideoX"):
        kwargs["max_sequence_length"] = pipe.transformer.config.max_text_seq_length
    latents = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        generator=torch.Generator("cpu").manual_seed(PIPELINE_REQUEST["seed"]),
        output_type="latent",
        **{key: config[key] for key in ("height", "width", "num_frames", "num_inference_steps")},
        **kwargs,
        **extra,
    ).frames
    if type(pipe).__name__.startswith("CogVideoX"):  # (B, F, C, H, W), CogVideoX 1.5 with its pad frame
        pad = config["stage2"]["dropped_pad_latent_frames"]
        latents = latents[:, pad:].permute(0, 2, 1, 3, 4)
    return latents


# LoRA adapters made here (tests/test_lora.py, tests/test_quantize.py) ---------------------------------------

LORA_TARGETS = {  # the blocks' attention and MLP projections (PEFT target_modules, full-match regexes)
    "wan": r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)",
    "cogvideox": r"transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
    "hunyuanvideo15": r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_k_proj)|ff\.net\.(0\.proj|2))",
    # both streams' self- and text attention, the audio<->video attentions, both feed-forwards
    "ltx2": r"transformer_blocks\.\d+\.((audio_)?attn[12]|audio_to_video_attn|video_to_audio_attn)"
    r"\.(to_q|to_k|to_v|to_out\.0)|transformer_blocks\.\d+\.(audio_)?ff\.net\.(0\.proj|2)",
}


def peft_weights(preset: str, seed: int, rank: int = 4, alpha: int | None = None, targets: str | None = None):
    """A random adapter's PEFT state dict (bare module keys) and config for the preset's transformer (on
    `targets`, else the family's LORA_TARGETS)."""
    from peft import LoraConfig, get_peft_model_state_dict

    from tpu_video import models

    source, family = models.resolve_model(preset)
    transformer = source.load("transformer")
    config = LoraConfig(
        r=rank, lora_alpha=alpha or rank, target_modules=targets or LORA_TARGETS[family.NAME], init_lora_weights=False
    )
    torch.manual_seed(seed)
    transformer.add_adapter(config)
    with torch.no_grad():  # PEFT's random init is kaiming-sized; keep the adapter a modest change
        for name, parameter in transformer.named_parameters():
            if "lora_" in name:
                parameter.mul_(0.5)
    return get_peft_model_state_dict(transformer), transformer


def diffusers_file(folder, name: str, preset: str, seed: int, targets: str | None = None):
    """The adapter saved by the family pipeline's save_lora_weights (keys `transformer.<module>.lora_A...`,
    its LoraConfig in the metadata)."""
    from diffusers.loaders import CogVideoXLoraLoaderMixin, LTX2LoraLoaderMixin, WanLoraLoaderMixin

    weights, transformer = peft_weights(preset, seed, targets=targets)
    savers = {"tiny-wan": WanLoraLoaderMixin, "tiny-ltx2": LTX2LoraLoaderMixin}
    saver = next((cls for start, cls in savers.items() if preset.startswith(start)), CogVideoXLoraLoaderMixin)
    metadata = transformer.peft_config["default"].to_dict()  # the LoraConfig, as diffusers' own saves carry it
    saver.save_lora_weights(
        folder, transformer_lora_layers=weights, weight_name=name, transformer_lora_adapter_metadata=metadata
    )
    return folder / name


def dequantized(linear: torch.nn.Linear, scheme: str) -> torch.nn.Linear:
    """The linear with its weight replaced by the scheme's dequantized values (weight-only schemes)."""
    from tpu_video.engine.quantize import fp8_per_row, int8_per_row

    values, scale = (fp8_per_row if scheme == "fp8_weight" else int8_per_row)(linear.weight.detach())
    with torch.no_grad():
        linear.weight.copy_(values.to(torch.float32) * scale)
    return linear


def dequantize_linears(transformer: torch.nn.Module, pattern: str, scheme: str) -> list[str]:
    """Every torch.nn.Linear of `transformer` whose name matches `pattern` (re.match) given the scheme's
    dequantized weights in place (a pipeline's reference for a quantized run); their names."""
    import re

    names = [
        name
        for name, module in transformer.named_modules()
        if type(module) is torch.nn.Linear and re.match(pattern, name)
    ]
    for name in names:
        parent, _, attribute = name.rpartition(".")
        owner = transformer.get_submodule(parent)
        setattr(owner, attribute, dequantized(getattr(owner, attribute), scheme))
    return names


def ltx2_reference(model, config: dict, output_type: str, adapters=(), **arguments):
    """LTX-2's pipeline's (video, audio) for the folder's request (prompts, seed, size), with LoRA `adapters`
    ((file, scale), ...) loaded its own way (load_lora_weights, set_adapters). `model`: a preset's name, or
    the pipeline itself."""
    pipe = pipeline(model) if isinstance(model, str) else model
    for index, (file, _) in enumerate(adapters):
        pipe.load_lora_weights(file, adapter_name=f"adapter_{index}")
    if adapters:
        pipe.set_adapters([f"adapter_{index}" for index in range(len(adapters))], [s for _, s in adapters])
    request = {key: config[key] for key in ("height", "width", "num_frames", "num_inference_steps")}
    output = pipe(
        prompt=config["prompt"],
        negative_prompt=config["negative_prompt"],
        generator=torch.Generator("cpu").manual_seed(config["seed"]),
        frame_rate=float(config["fps"]),
        output_type=output_type,
        **{**request, **arguments},  # `arguments` may replace a request value (num_frames=None: the duration head's)
    )
    return output.frames, output.audio


def enhancer_calls(monkeypatch, pipeline_class: str) -> list[dict]:
    """What each call of diffusers' enhance_prompt on `pipeline_class` (an LTX-2 pipeline's name) got (the seed it
    used: the generator's where one is given) and returned. On the tiny text encoder the sampled text hardly
    depends on the instructions or the image (its logits are nearly flat), so tests compare the arguments as well
    as the text."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    calls, stock = [], cls.enhance_prompt

    def recorded(self, prompt, system_prompt, *args, seed=10, generator=None, image=None, **kwargs):
        text = stock(self, prompt, system_prompt, *args, seed=seed, generator=generator, image=image, **kwargs)
        used_seed = seed if generator is None else generator.initial_seed()
        pixels = None if image is None else np.asarray(image).tobytes()
        calls.append(
            {"prompt": prompt, "system_prompt": system_prompt, "seed": used_seed, "image": pixels, "text": text}
        )
        return text

    monkeypatch.setattr(cls, "enhance_prompt", recorded)
    return calls


def write_video(path, frames: int = 9, height: int = 40, width: int = 56, pattern=None) -> None:
    """A smooth moving pattern (or `pattern(t, y, x)`: uint8 RGB frames) as an H.264 mp4 (lossy: both sides
    of a comparison read the same decoded frames)."""
    import imageio_ffmpeg

    y, x = np.mgrid[0:height, 0:width]
    writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=8, macro_block_size=8)
    writer.send(None)
    for t in range(frames):
        if pattern is not None:
            writer.send(np.ascontiguousarray(pattern(t, y, x), dtype=np.uint8).tobytes())
            continue
        red = 127 + 120 * np.sin((x + 3 * t) / 6.0)
        green = 127 + 120 * np.cos((y - 2 * t) / 5.0)
        blue = 127 + 100 * np.sin((x + y + t) / 9.0)
        writer.send(np.stack([red, green, blue], axis=-1).astype(np.uint8).tobytes())
    writer.close()


def decoded_frames(path):
    """The mp4's frames as PIL images, decoded here with imageio-ffmpeg (as the pipeline's users load them)."""
    import imageio_ffmpeg
    from PIL import Image

    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    width, height = next(reader)["size"]
    return [Image.frombytes("RGB", (width, height), bytes(chunk)) for chunk in reader]
