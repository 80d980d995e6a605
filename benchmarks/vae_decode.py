#!/usr/bin/env python
"""Stage 3's decode on this CPU, side by side in one run: diffusers' `vae.decode` eager in PyTorch against
the frame programs `--backend torchax` runs (tpu_video/models/wan/vae.py, cogvideox/vae.py, hunyuanvideo15/vae.py),
on a published VAE's widths with random weights at a reduced video size. Each in a fresh process: seconds
(the torchax placement and compile, then a second decode timed alone), peak resident memory, and the
relative error against eager. Prints a table and one JSON line.

    python benchmarks/vae_decode.py [--family wan] [--frames 9] [--height 240] [--width 416] [--devices 1]
        [--chunk_frames N]
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


# The published model whose VAE each --family measures (configs from its family's published.py, no network).
PUBLISHED = {
    "wan": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
    "cogvideox": "zai-org/CogVideoX1.5-5B",
    "hunyuanvideo15": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
}


def build(folder: Path, family: str) -> None:
    """The published VAE config with random weights, as a model folder beside that model's index."""
    import torch

    from tpu_video import models

    source, _ = models.resolve_model(PUBLISHED[family], configs_only=True)
    torch.manual_seed(0)
    source.component_class("vae").from_config(source.load_config("vae")).eval().save_pretrained(folder / "vae")
    index = json.loads((Path(source.location) / "model_index.json").read_text())
    index = {key: value for key, value in index.items() if key.startswith("_") or key == "vae"}
    (folder / "model_index.json").write_text(json.dumps(index))


def measure(folder: str, mode: str, frames: int, height: int, width: int, chunk: int | None, out: str) -> dict:
    """In a fresh process: decode the same random latents with diffusers' decode eagerly (`eager`), or with
    the frame programs on torchax (`frames`: the first call compiles, the second is timed alone)."""
    import torch

    from tpu_video import models
    from tpu_video.engine.decode import LATENTS_WIDTH_SPLIT

    source, family = models.resolve_model(folder)
    config = source.load_config("vae")
    channels = config.get("z_dim") or config["latent_channels"]
    spatial = config.get("spatial_compression_ratio") or config.get("scale_factor_spatial") or 8
    chunk = chunk or family.CHUNK_FRAMES[0]
    latent = ((frames - 1) // 4 + 1, height // spatial, width // spatial)
    latents = torch.randn(1, channels, *latent, generator=torch.Generator().manual_seed(1))
    decoder = family.Decoder(source.load("vae", dtype=torch.float32).eval(), family.latents_normalization(source))
    seconds = {}
    with torch.no_grad():
        if mode == "eager":
            start = time.perf_counter()
            video = decoder(latents)
            seconds["decode"] = time.perf_counter() - start
        else:
            import sharding
            from tpu_video.runtime import placement
            from tpu_video.runtime.torchax_runtime import TorchaxRuntime

            runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=int(os.environ["DEVICES"]))))
            with runtime.precision(torch.float32):
                start = time.perf_counter()
                run = family.frame_programs(source, decoder, latents.shape, runtime, LATENTS_WIDTH_SPLIT, chunk)
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
    parser.add_argument("--family", choices=sorted(PUBLISHED), default="wan", help="whose VAE (default: wan)")
    parser.add_argument("--chunk_frames", type=int, help="latent frames per call (default: the family's)")
    parser.add_argument("--frames", type=int, default=9, help="video frames, 4n+1 (default: %(default)s)")
    parser.add_argument("--height", type=int, default=240, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--width", type=int, default=416, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices for torchax (default: %(default)s)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, mode, out = args.child
        print(json.dumps(measure(folder, mode, args.frames, args.height, args.width, args.chunk_frames, out)))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, args.family)
        runs, videos = {}, {}
        for mode in ("eager", "frames"):
            out = folder / f"{mode}.pt"
            env = {**os.environ, "DEVICES": str(args.devices), "JAX_PLATFORMS": "cpu"}
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
            size = ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
            if args.chunk_frames:
                size += ["--chunk_frames", str(args.chunk_frames)]
            command = [sys.executable, __file__, *size, "--child", str(folder), mode, str(out)]
            done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            runs[mode] = json.loads(done.stdout.splitlines()[-1])  # after the log lines
            videos[mode] = torch.load(out)
    error = ((videos["frames"] - videos["eager"]).norm() / videos["eager"].norm()).item()
    eager, frames = runs["eager"], runs["frames"]
    decode_ratio = frames["seconds"]["decode"] / eager["seconds"]["decode"]
    result = {
        "family": args.family,
        "vae_of": PUBLISHED[args.family],
        "chunk_frames": args.chunk_frames,
        "video": [args.frames, args.height, args.width],
        "devices": args.devices,
        "runs": runs,
        "relative_error": error,
        "decode_time_ratio_frames_over_eager": round(decode_ratio, 3),
    }
    gib = 2**30
    print(f"{PUBLISHED[args.family]}'s VAE (random weights), {args.frames} x {args.height} x {args.width}")
    for mode, run in runs.items():
        phases = ", ".join(f"{key} {value} s" for key, value in run["seconds"].items())
        print(f"{mode:7s} {phases}; peak RSS {run['peak_rss_bytes'] / gib:.2f} GiB")
    print(f"decode phase, frames / eager: {result['decode_time_ratio_frames_over_eager']}; relative error {error:.2e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
