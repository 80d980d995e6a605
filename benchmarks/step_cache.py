"""Step caching on CPU, side by side in one run; prints a table and one JSON line.

A mid-size CogVideoX-1.5-like pipeline (the tiny preset's text encoder, VAE and scheduler around a
transformer of 8 layers x 8 heads x 64, saved and loaded with from_pretrained), through the real stage
scripts: stage 1 once, then stage 2 with --cache_calibrate (every step computed; writes the magnitude
ratios), uncached, with MagCache at two thresholds using those ratios, and with the interval cache;
stage 3 decodes each. For each run: median full and cached step, the denoise phase, and the
error of its latents and frames against the uncached run (relative error, PSNR of the 8-bit frames).

Random weights say little about real video quality: the errors show what the caches change, not how
a real model's video looks. The speed ratios are what transfers (a cached step skips the span's blocks).

    python benchmarks/step_cache.py [--steps 20] [--frames 17]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch  # noqa: E402

MODEL = {"num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 64}
HEIGHT, WIDTH = 96, 160  # the transformer's sample size is set to match (CogVideoX-1.5's rotary grid)


def build_pipeline(folder: Path) -> None:
    """The tiny CogVideoX-1.5 preset with a mid-size transformer, saved as a model folder."""
    from diffusers import CogVideoXTransformer3DModel

    from tpu_video.models import cogvideox

    pipe = cogvideox.presets.tiny_pipeline("1.5")
    config = dict(pipe.transformer.config)
    torch.manual_seed(0)
    keys = ("in_channels", "out_channels", "time_embed_dim", "text_embed_dim")
    keys += ("sample_frames", "patch_size", "patch_size_t", "patch_bias", "temporal_compression_ratio")
    keys += ("max_text_seq_length", "use_rotary_positional_embeddings")
    sample = {"sample_height": HEIGHT // 8, "sample_width": WIDTH // 8}
    pipe.transformer = CogVideoXTransformer3DModel(**{key: config[key] for key in keys}, **sample, **MODEL).eval()
    pipe.save_pretrained(folder)


def run(module, argv) -> None:
    """A stage's main() in this process, as its `__main__` block runs it."""
    from tpu_video.cli import run_cli

    run_cli(lambda: module.main([str(arg) for arg in argv]))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def psnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """PSNR in dB of frames in [0, 1] quantised to 8 bits, as the mp4 would hold them."""
    a, e = ((x.clamp(0, 1) * 255).round() for x in (actual, expected))
    mse = ((a - e) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frames", type=int, default=17)
    args = parser.parse_args()
    import stage1_text_encoder
    import stage2_transformer
    import stage3_vae_decoder
    from utils import read_config, read_tensors

    work = Path(tempfile.mkdtemp(prefix="step-cache-"))
    os.environ.setdefault("TPU_VIDEO_CACHE", str(work / "cache"))
    build_pipeline(work / "model")
    request = ["--height", HEIGHT, "--width", WIDTH, "--num_frames", args.frames, "--num_inference_steps", args.steps]
    start, end = args.steps // 5, args.steps - args.steps // 10  # the reference's 11/45 of 50, scaled
    runs = {
        "calibrate": ["--cache_calibrate"],  # computes every step, plus the ratios; writes mag_ratios.json
        "uncached": [],
        "magcache 0.06": ["--cache", "magcache"],
        "magcache 0.24": ["--cache", "magcache", "--cache_threshold", 0.24],
        "interval": [
            "--enable_cache",
            "--cache_start_step",
            start,
            "--cache_end_step",
            end,
            "--cache_step_interval",
            3,
        ],
    }
    stage1 = work / "stage1"
    run(
        stage1_text_encoder,
        ["--model", work / "model", "--prompt", "a red cat", "--output_dir", stage1, "--dtype", "fp32", *request],
    )
    results = {}
    for name, flags in runs.items():
        out = work / name.replace(" ", "-")
        out.mkdir()
        for file in stage1.iterdir():
            (out / file.name).write_bytes(file.read_bytes())
        if name != "calibrate":
            (out / "mag_ratios.json").write_bytes((work / "calibrate" / "mag_ratios.json").read_bytes())
        run(stage2_transformer, ["--input_dir", out, "--warmup_steps", 1, *flags])
        run(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
        config = read_config(out)
        section = config["stage2"]
        results[name] = {
            "latents": read_tensors(out, section)["latents"],
            "frames": _frames(out),
            "denoise_seconds": section["seconds"]["denoise"],
            "cache": section.get("step_cache", {}),
            "median_step": sorted(section["step_seconds"])[len(section["step_seconds"]) // 2],
        }
    base = results["uncached"]
    rows = []
    for name, result in results.items():
        cache = result["cache"]
        rows.append(
            {
                "run": name,
                "schedule": cache.get("schedule", "F" * args.steps),
                "median_full_step_s": cache.get("median full step", result["median_step"]),
                "median_cached_step_s": cache.get("median cached step"),
                "denoise_s": result["denoise_seconds"],
                "denoise_speedup": round(base["denoise_seconds"] / result["denoise_seconds"], 2),
                "latents_rel_err": relative_error(result["latents"], base["latents"]),
                "frames_rel_err": relative_error(result["frames"], base["frames"]),
                "frames_psnr_db": psnr(result["frames"], base["frames"]),
            }
        )
    print(
        f"mid-size CogVideoX-1.5-like transformer {MODEL}, {HEIGHT}x{WIDTH}, {args.frames} frames, "
        f"{args.steps} steps, fp32, CPU"
    )
    header = ("run", "schedule", "median_full_step_s", "median_cached_step_s", "denoise_s", "denoise_speedup")
    header += ("latents_rel_err", "frames_rel_err", "frames_psnr_db")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(_cell(row[key]) for key in header))
    print(json.dumps({"model": MODEL, "steps": args.steps, "frames": args.frames, "rows": rows}))


def _frames(out: Path) -> torch.Tensor:
    """The decoded frames before quantisation (stage 3's --save_frames), float32 in [0, 1]."""
    from safetensors.torch import load_file

    (path,) = out.glob("*_frames.safetensors")
    return load_file(str(path))["frames_float"]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    main()
