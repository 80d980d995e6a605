#!/usr/bin/env python
"""Stage 3: decode stage 2's latents with the pipeline's VAE and write an mp4.

`--backend torch` runs plain PyTorch on CPU or CUDA and never imports JAX (for GPU hosts);
`--backend torchax` runs the same VAE on a JAX device. The VAE scaling factor is undone exactly as
the diffusers pipeline does before decoding.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import models
from utils import (
    DEFAULT_OUTPUT_DIR,
    VIDEO_FILE,
    Timer,
    TorchRuntime,
    UserError,
    apply_request_overrides,
    ensure_writable_dir,
    library_versions,
    log,
    parse_dtype,
    read_config,
    read_tensors,
    run_cli,
    write_config,
    write_mp4,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--input_dir", default=DEFAULT_OUTPUT_DIR, help="folder with stage 2's files (default: %(default)s)"
    )
    parser.add_argument("--output_dir", help="where to write the video and config (default: --input_dir)")
    parser.add_argument("--output_name", default=VIDEO_FILE, help="video file name (default: %(default)s)")
    parser.add_argument("--model", help="override the model recorded by stage 1 (same family only)")
    parser.add_argument("--backend", choices=("torch", "torchax"), default="torch", help="default: %(default)s")
    parser.add_argument("--device", default="cpu", help="torch device for --backend torch (default: %(default)s)")
    parser.add_argument("--dtype", help="bf16, fp16 or fp32 for the VAE (default: the request's dtype)")
    parser.add_argument("--fps", type=int, help="override the request's frames per second")
    parser.add_argument(
        "--tiling", action="store_true", help="decode in spatial tiles (diffusers' VAE tiling) to save memory"
    )
    return parser.parse_args(argv)


def make_runtime(backend: str, device: str):
    if backend == "torch":
        return TorchRuntime(device)
    from torchax_runtime import TorchaxRuntime

    return TorchaxRuntime()


def main(argv=None) -> None:
    args = parse_args(argv)
    input_dir = Path(args.input_dir)
    output_dir = Path(args.output_dir or args.input_dir)
    timer = Timer()

    config = read_config(input_dir, needs="stage2")
    source, family = models.resolve_model_for_config(config, args.model)
    overrides = apply_request_overrides(config, {"fps": args.fps})
    if config["fps"] <= 0:
        raise UserError(f"--fps {config['fps']} must be positive")
    if not config["stage2"].get("latents_scaled_by_vae_scaling_factor"):
        raise UserError(f"{input_dir}: stage 2 did not record the latents' scaling; rerun stage 2")
    dtype_name = args.dtype or config["dtype"]
    dtype = parse_dtype(dtype_name)
    latents = read_tensors(input_dir, config["stage2"])["latents"]
    ensure_writable_dir(output_dir)

    runtime = make_runtime(args.backend, args.device)
    log(f"decoding latents {tuple(latents.shape)} with the {family.NAME} VAE on {args.backend}, {dtype_name}")
    frames = family.decode(source, latents, dtype, runtime, timer, tiling=args.tiling)
    pixels = (frames.numpy() * 255).round().astype(np.uint8)
    with timer.phase("save"):
        write_mp4(output_dir / args.output_name, pixels, config["fps"])

    count, height, width, _ = pixels.shape
    config["stage3"] = {
        "file": args.output_name,
        "latents_sha256": config["stage2"]["sha256"],
        "frames": count,
        "height": height,
        "width": width,
        "fps": config["fps"],
        "backend": args.backend,
        "device": args.device if args.backend == "torch" else "jax",
        "dtype": dtype_name,
        "tiling": args.tiling,
        "overrides": overrides,
        "seconds": timer.seconds,
        "versions": library_versions("torch", "diffusers", "imageio-ffmpeg"),
    }
    write_config(output_dir, config)
    log(f"wrote {output_dir / args.output_name}: {count} frames x {height} x {width} at {config['fps']} fps")


if __name__ == "__main__":
    run_cli(main)
