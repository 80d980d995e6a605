#!/usr/bin/env python
"""LTX-2's soundtrack decode (tpu_video/models/ltx2/audio.py: the audio VAE and the vocoder as one module): the
published components (configs from tpu_video/models/ltx2/published.py, random weights, normal 0.02) on the audio latents
of a video of `--num_frames` at `--fps`. By default, eager PyTorch on this CPU, as stage 3 runs it: seconds of the best
of `--repeats` decodes after one warm-up, for each dtype. With `--plan TARGET` (e.g. v6e-8), instead the soundtrack's
program compiled by the TPU compiler (weights replicated), in bf16: compile seconds, HBM per device (code size apart)
and FLOPs, which is why stage 3 keeps it on the host. Prints one JSON line.

    python benchmarks/ltx2_audio_decode.py [--model Lightricks/LTX-2] [--num_frames 121] [--fps 24]
        [--dtypes fp32 bf16] [--repeats 2] [--plan v6e-8 [--part all|vae|vocoder]]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_module(source, component: str, dtype):
    """The published component at its widths with random weights (normal 0.02; buffers as built)."""
    from tpu_video.engine.meta import meta_module

    module = meta_module(source, component, dtype).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.normal_(0.0, 0.02)
        for tensor in module.buffers():
            if tensor.is_floating_point():
                tensor.fill_(1.0)  # e.g. the audio VAE's latent statistics: ones keep the decode finite
    return module.eval()


def plan_soundtrack(source, latents, target_name: str, part: str) -> dict:
    """The soundtrack (or its audio VAE or vocoder alone) in bf16 compiled for `target_name`'s devices."""
    from sharding import REPLICATED_TABLE, MeshShape
    from tpu_video.engine.meta import meta_module
    from tpu_video.models.ltx2.audio import Soundtrack
    from tpu_video.planning import plan
    from tpu_video.planning.flags import target_from_flag
    from tpu_video.planning.tpus import topology_mesh
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    target = target_from_flag(target_name)
    mesh = topology_mesh(target, MeshShape(sp=target.devices))
    dtype = torch.bfloat16
    audio_vae, vocoder = (meta_module(source, name, dtype) for name in Soundtrack.COMPONENTS)
    latents = latents.to(dtype)
    if part == "vocoder":
        with torch.no_grad():
            mel = audio_vae.decode(latents.to("meta"), return_dict=False)[0]
        module, inputs = vocoder, torch.zeros(mel.shape, dtype=dtype)
    else:
        module = Soundtrack(audio_vae, vocoder) if part == "all" else DecodeOnly(audio_vae)
        inputs = latents
    compiled = plan.compile_module(module, REPLICATED_TABLE, [(inputs, ())], mesh, TorchaxRuntime(mesh).env)
    memory = compiled.memory or {}
    return {
        "target": target.name,
        "part": part,
        "input": list(inputs.shape),
        "compile_seconds": round(compiled.seconds, 1),
        "code_mib": round(memory.get("code", 0) / 2**20, 1),
        "hbm_total_mib": round(memory.get("total", 0) / 2**20, 1),
        "flops_per_device": compiled.flops,
        "seconds_lower_bound": compiled.flops / target.bf16_flops_per_device,
    }


class DecodeOnly(torch.nn.Module):
    """The audio VAE's decode as a module's forward (the soundtrack's first half)."""

    def __init__(self, audio_vae: torch.nn.Module) -> None:
        super().__init__()
        self.audio_vae = audio_vae

    def forward(self, latents):
        return self.audio_vae.decode(latents, return_dict=False)[0]


def main() -> None:
    from tpu_video import models
    from tpu_video.models.ltx2.audio import Soundtrack
    from tpu_video.models.ltx2.config import audio_frames

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Lightricks/LTX-2")
    parser.add_argument("--num_frames", type=int, default=121)
    parser.add_argument("--fps", type=float, default=24.0)
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plan", help="a TPU target (e.g. v6e-8): compile the program for it instead of timing")
    parser.add_argument("--part", choices=("all", "vae", "vocoder"), default="all", help="with --plan")
    args = parser.parse_args()

    source, _ = models.resolve_model(args.model, configs_only=True)
    frames = audio_frames(source, SimpleNamespace(num_frames=args.num_frames, fps=args.fps))
    config = source.load_config("audio_vae")
    mel_bins = config["mel_bins"] // 4  # the latents' mel axis (4x compression)
    latents = torch.randn(1, config["latent_channels"], frames, mel_bins)
    result = {"model": args.model, "seconds_of_sound": args.num_frames / args.fps, "latents": list(latents.shape)}
    if args.plan:
        result.update(plan_soundtrack(source, latents, args.plan, args.part))
        print(json.dumps(result))
        return
    result["threads"] = torch.get_num_threads()
    for name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        soundtrack = Soundtrack(*(random_module(source, component, dtype) for component in Soundtrack.COMPONENTS))
        best = float("inf")
        for attempt in range(args.repeats + 1):
            start = time.perf_counter()
            with torch.no_grad():
                waveform = soundtrack(latents)
            if attempt:
                best = min(best, time.perf_counter() - start)
        shape = list(waveform[0].shape)
        result[name] = {"seconds": round(best, 3), "samples": shape, "sample_rate": soundtrack.sample_rate}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
