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
    CONFIG_FILE,
    DEFAULT_OUTPUT_DIR,
    VIDEO_FILE,
    Timer,
    TorchRuntime,
    UserError,
    apply_request_overrides,
    ensure_writable_dir,
    filter_harmless_warnings,
    library_versions,
    log,
    parse_dtype,
    read_config,
    read_tensors,
    run_cli,
    torch_device,
    torchax_runtime_on_all_devices,
    write_config,
    write_mp4,
    write_preview_png,
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
    parser.add_argument("--device", help="torch device for --backend torch (default: cpu)")
    parser.add_argument("--dtype", help="bf16, fp16 or fp32 for the VAE (default: the request's dtype)")
    parser.add_argument("--fps", type=int, help="override the request's frames per second")
    parser.add_argument(
        "--tiling", action="store_true", help="decode in spatial tiles (diffusers' VAE tiling) to save memory"
    )
    parser.add_argument(
        "--preview_frames",
        type=int,
        default=8,
        help="frames in the preview PNG grid, 0 for none (default: %(default)s)",
    )
    parser.add_argument(
        "--no_compile_cache", action="store_true", help="torchax: do not use the persistent JAX compilation cache"
    )
    return parser.parse_args(argv)


def preview_name(video_name: str) -> str:
    return str(Path(video_name).with_suffix("")) + "_preview.png"


def main(argv=None) -> None:
    args = parse_args(argv)
    filter_harmless_warnings()
    device = torch_device(args.backend, args.device)
    if args.preview_frames < 0:
        raise UserError(f"--preview_frames {args.preview_frames} must be >= 0")
    input_dir = Path(args.input_dir)
    output_dir = Path(args.output_dir or args.input_dir)
    timer = Timer()

    config = read_config(input_dir, needs="stage2")
    source, family = models.resolve_model_for_config(config, args.model)
    overrides = apply_request_overrides(config, {"fps": args.fps})
    if config["fps"] <= 0:
        raise UserError(f"--fps {config['fps']} must be positive")
    stage2 = config["stage2"]
    changed = [key for key, value in stage2.get("request", {}).items() if config.get(key) != value]
    if stage2.get("stage1_sha256") != config["stage1"]["sha256"]:
        changed.insert(0, "embeddings")
    if changed:
        raise UserError(
            f"{input_dir / CONFIG_FILE}: the stage2 section is stale, stage 1 was rerun since "
            f"({', '.join(changed)} changed); rerun stage 2"
        )
    if not config["stage2"].get("latents_scaled_by_vae_scaling_factor"):
        raise UserError(f"{input_dir}: stage 2 did not record the latents' scaling; rerun stage 2")
    dtype_name = args.dtype or config["dtype"]
    dtype = parse_dtype(dtype_name)
    latents = read_tensors(input_dir, config["stage2"])["latents"]
    ensure_writable_dir(output_dir)

    compile_cache = None
    if args.backend == "torch":
        runtime = TorchRuntime(device)
    else:  # the VAE's weights are replicated; its activations are split along width over all devices
        runtime, compile_cache = torchax_runtime_on_all_devices("sp", compile_cache=not args.no_compile_cache)
    log(f"decoding latents {tuple(latents.shape)} with the {family.NAME} VAE on {args.backend}, {dtype_name}")
    frames = family.decode(source, latents, dtype, runtime, timer, tiling=args.tiling)
    pixels = (frames.numpy() * 255).round().astype(np.uint8)
    with timer.phase("save"):
        write_mp4(output_dir / args.output_name, pixels, config["fps"])
        preview = None
        if args.preview_frames:
            preview = preview_name(args.output_name)
            rows, columns = write_preview_png(output_dir / preview, pixels, count=args.preview_frames)

    count, height, width, _ = pixels.shape
    config["stage3"] = {
        "file": args.output_name,
        **({"preview": preview, "preview_grid": [rows, columns]} if preview else {}),
        "latents_sha256": config["stage2"]["sha256"],
        "frames": count,
        "height": height,
        "width": width,
        "fps": config["fps"],
        "backend": args.backend,
        **({"device": device} if args.backend == "torch" else runtime.device_description),
        "dtype": dtype_name,
        "tiling": args.tiling,
        "overrides": overrides,
        **({"compile_cache": compile_cache.report()} if compile_cache else {}),
        "seconds": timer.finish(),
        "versions": library_versions("torch", "diffusers", "imageio-ffmpeg"),
    }
    write_config(output_dir, config)
    log(f"wrote {output_dir / args.output_name}: {count} frames x {height} x {width} at {config['fps']} fps")


if __name__ == "__main__":
    run_cli(main)
