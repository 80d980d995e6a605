#!/usr/bin/env python
"""Stage 3's decode on this CPU, side by side in one run: diffusers' `vae.decode` eager in PyTorch against
the frame-by-frame programs `--backend torchax` runs (models/wan_vae.py), on the published Wan 2.1 VAE's
widths with random weights at a reduced video size. Each in a fresh process: seconds (the torchax placement
and compile, then a second decode timed alone), peak resident memory, and the relative error against eager.
Prints a table and one JSON line.

    python benchmarks/vae_decode.py [--frames 9] [--height 240] [--width 416] [--devices 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(folder: Path) -> None:
    """The published Wan 2.1 VAE config (models/published.py) with random weights, as a model folder."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    AutoencoderKLWan().eval().save_pretrained(folder / "vae")  # the class defaults are the Wan 2.1 VAE
    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1", "vae": ["diffusers", "AutoencoderKLWan"]}
    (folder / "model_index.json").write_text(json.dumps(index))


def measure(folder: str, mode: str, frames: int, height: int, width: int, out: str) -> dict:
    """In a fresh process: decode the same random latents with diffusers' decode eagerly (`eager`), or with
    the frame programs on torchax (`frames`: the first call compiles, the second is timed alone)."""
    import torch

    import models
    from models import wan
    from models.common import LATENTS_WIDTH_SPLIT

    source, family = models.resolve_model(folder)
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(1, 16, *latent, generator=torch.Generator().manual_seed(1))
    decoder = family.Decoder(source.load("vae", dtype=torch.float32).eval(), wan.latents_normalization(source))
    seconds = {}
    with torch.no_grad():
        if mode == "eager":
            start = time.perf_counter()
            video = decoder(latents)
            seconds["decode"] = time.perf_counter() - start
        else:
            import sharding
            from runtime.torchax_runtime import TorchaxRuntime

            runtime = TorchaxRuntime(sharding.make_mesh(sharding.MeshShape(sp=int(os.environ["DEVICES"]))))
            with runtime.precision(torch.float32):
                start = time.perf_counter()
                run = family.frame_programs(source, decoder, latents.shape, runtime, LATENTS_WIDTH_SPLIT)
                run(latents)
                seconds["place_and_compile"] = time.perf_counter() - start
                start = time.perf_counter()
                video = run(latents)
                seconds["decode"] = time.perf_counter() - start
    torch.save(video, out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": {key: round(value, 2) for key, value in seconds.items()}, "peak_rss_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=9, help="video frames, 4n+1 (default: %(default)s)")
    parser.add_argument("--height", type=int, default=240, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--width", type=int, default=416, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices for torchax (default: %(default)s)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, mode, out = args.child
        print(json.dumps(measure(folder, mode, args.frames, args.height, args.width, out)))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder)
        runs, videos = {}, {}
        for mode in ("eager", "frames"):
            out = folder / f"{mode}.pt"
            env = {**os.environ, "DEVICES": str(args.devices), "JAX_PLATFORMS": "cpu"}
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
            size = ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
            command = [sys.executable, __file__, *size, "--child", str(folder), mode, str(out)]
            done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            runs[mode] = json.loads(done.stdout.splitlines()[-1])  # after the log lines
            videos[mode] = torch.load(out)
    error = ((videos["frames"] - videos["eager"]).norm() / videos["eager"].norm()).item()
    eager, frames = runs["eager"], runs["frames"]
    decode_ratio = frames["seconds"]["decode"] / eager["seconds"]["decode"]
    result = {
        "video": [args.frames, args.height, args.width],
        "devices": args.devices,
        "runs": runs,
        "relative_error": error,
        "decode_time_ratio_frames_over_eager": round(decode_ratio, 3),
    }
    gib = 2**30
    print(f"Wan 2.1 VAE (published widths, random weights), {args.frames} x {args.height} x {args.width}")
    for mode, run in runs.items():
        phases = ", ".join(f"{key} {value} s" for key, value in run["seconds"].items())
        print(f"{mode:7s} {phases}; peak RSS {run['peak_rss_bytes'] / gib:.2f} GiB")
    print(f"decode phase, frames / eager: {result['decode_time_ratio_frames_over_eager']}; relative error {error:.2e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
