#!/usr/bin/env python
"""Host memory of fusing a LoRA adapter, side by side in one run; prints a table and one JSON line.

A Wan 2.1 14B-width transformer (5120 wide, 40 heads, FFN 13824: the published config) with few blocks,
random weights saved in bf16 as a model folder, and a rank-64 adapter on every attention and FFN projection of
every block (the shape of the 4-step distillation adapters), saved as diffusers saves adapters. Two fresh
processes load the transformer exactly as stage 2 does (`from_pretrained`); the second also reads the adapter
and fuses it (tpu_video/engine/lora.py). Each reports its peak resident memory (ru_maxrss) and the seconds taken.
The bound checked: peak with the adapter <= 1.1 x (peak without + the adapter file).

    python benchmarks/lora_memory.py [--layers 2] [--rank 64]
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
os.environ.setdefault("JAX_PLATFORMS", "cpu")

TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"


def wide_wan(folder: Path, layers: int):
    """A Wan 2.1 14B-width transformer (published config) with `layers` blocks and random bf16 weights, saved
    as a model folder (model_index.json + transformer); returns it."""
    import torch
    from diffusers import WanTransformer3DModel

    from tpu_video.models.wan.published import WAN_14B_TRANSFORMER

    torch.manual_seed(0)
    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config({**WAN_14B_TRANSFORMER, "num_layers": layers})
    transformer = transformer.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.normal_(0, 0.02)
    transformer.save_pretrained(folder / "transformer")
    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1"}
    index["transformer"] = ["diffusers", "WanTransformer3DModel"]
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    return transformer


def build(folder: Path, layers: int, rank: int) -> Path:
    """The model folder (model_index.json + transformer) and the adapter file; returns the adapter's path."""
    from diffusers.loaders import WanLoraLoaderMixin
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = wide_wan(folder, layers)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False))
    weights = get_peft_model_state_dict(transformer)
    WanLoraLoaderMixin.save_lora_weights(folder, transformer_lora_layers=weights, weight_name="adapter.safetensors")
    return folder / "adapter.safetensors"


def measure(folder: str, adapter: str | None) -> dict:
    """In a fresh process: load the transformer as stage 2 does, fuse the adapter if given."""

    import torch

    from tpu_video import models
    from tpu_video.engine import lora

    source, family = models.resolve_model(folder)
    start = time.perf_counter()
    adapters = []
    if adapter:
        adapters = lora.read_adapters([("--lora", adapter)], family, source, torch.bfloat16)
    transformers = {"transformer": source.load("transformer", dtype=torch.bfloat16).eval()}
    loaded = time.perf_counter()
    if adapters:
        lora.fuse(transformers, adapters, family)
    return {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_seconds": round(loaded - start, 2),
        "fuse_seconds": round(time.perf_counter() - loaded, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=64, help="adapter rank (default: %(default)s)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] if len(args.child) > 1 else None)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        adapter = build(folder, args.layers, args.rank)
        model_bytes = sum(p.stat().st_size for p in (folder / "transformer").glob("*.safetensors"))
        adapter_bytes = adapter.stat().st_size
        runs = {}
        for name, extra in (("without adapter", []), ("with adapter", [str(adapter)])):
            command = [sys.executable, __file__, "--child", str(folder), *extra]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            runs[name] = json.loads(done.stdout.splitlines()[-1])  # after the log lines
    base, fused = runs["without adapter"]["peak_rss_bytes"], runs["with adapter"]["peak_rss_bytes"]
    result = {
        "layers": args.layers,
        "rank": args.rank,
        "model_file_bytes": model_bytes,
        "adapter_file_bytes": adapter_bytes,
        "runs": runs,
        "peak_ratio_to_base_plus_adapter": round(fused / (base + adapter_bytes), 3),
        "bound": 1.1,
    }
    gib = 2**30
    print(f"model file {model_bytes / gib:.2f} GiB ({args.layers} blocks of Wan 14B width), rank {args.rank}")
    for name, run in runs.items():
        print(
            f"{name:16s} peak RSS {run['peak_rss_bytes'] / gib:6.2f} GiB  load {run['load_seconds']:6.2f} s  "
            f"fuse {run['fuse_seconds']:6.2f} s"
        )
    print(f"peak with / (peak without + adapter file): {result['peak_ratio_to_base_plus_adapter']} (bound 1.1)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
