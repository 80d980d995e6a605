#!/usr/bin/env python
"""LTX-2's soundtrack decode on this CPU, as stage 3 runs it on the host (models/ltx2/audio.py): the published
audio VAE and vocoder (configs from models/ltx2/published.py, random weights, normal 0.02) on the audio latents
of a video of `--num_frames` at `--fps`, eager PyTorch. Seconds of the best of `--repeats` decodes after one
warm-up, for each dtype. Prints one JSON line.

    python benchmarks/ltx2_audio_decode.py [--model Lightricks/LTX-2] [--num_frames 121] [--fps 24]
        [--dtypes fp32 bf16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_module(source, component: str, dtype):
    """The published component at its widths with random weights (normal 0.02; buffers as built)."""
    import torch

    from models.meta import meta_module

    module = meta_module(source, component, dtype).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.normal_(0.0, 0.02)
        for tensor in module.buffers():
            if tensor.is_floating_point():
                tensor.fill_(1.0)  # e.g. the audio VAE's latent statistics: ones keep the decode finite
    return module.eval()


def main() -> None:
    import torch

    import models
    from models.ltx2.audio import decode_audio
    from models.ltx2.config import audio_frames

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Lightricks/LTX-2")
    parser.add_argument("--num_frames", type=int, default=121)
    parser.add_argument("--fps", type=float, default=24.0)
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    source, _ = models.resolve_model(args.model, configs_only=True)
    frames = audio_frames(source, SimpleNamespace(num_frames=args.num_frames, fps=args.fps))
    config = source.load_config("audio_vae")
    result = {"model": args.model, "seconds_of_sound": args.num_frames / args.fps, "threads": torch.get_num_threads()}
    for name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        parts = {component: random_module(source, component, dtype) for component in ("audio_vae", "vocoder")}
        folder = SimpleNamespace(load=lambda component, dtype=None, parts=parts: parts[component])  # decode_audio's

        mel_bins = config["mel_bins"] // 4  # the latents' mel axis (4x compression)
        latents = {"audio_latents": torch.randn(1, config["latent_channels"], frames, mel_bins)}
        best = float("inf")
        for attempt in range(args.repeats + 1):
            start = time.perf_counter()
            waveform, rate = decode_audio(folder, latents, dtype)
            if attempt:
                best = min(best, time.perf_counter() - start)
        result[name] = {"seconds": round(best, 3), "samples": list(waveform.shape), "sample_rate": rate}
    result["latents"] = [1, config["latent_channels"], frames, config["mel_bins"] // 4]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
