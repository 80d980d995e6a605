#!/usr/bin/env python
"""Stage 2's weight loading against a plain read of the same files, side by side in one run; prints a table
and one JSON line.

A Wan 2.1 14B-width transformer (the published config) with `--layers` blocks and random bf16 weights, saved
as a model folder, plus a rank-64 adapter on every attention and FFN projection. Each row is a fresh process
on `--devices` CPU devices (tp over all of them):

- `raw read`: every safetensors file read into memory (`open().read()`), nothing else;
- `direct`: what stage 2 does with nothing to change on the host (tpu_video/engine/direct_load.py): built on the meta
  device, then each device's slices read from the files as they are placed, unrolled or under the block scan;
- `from_pretrained`: the whole transformer read on the host first, then placed (stage 2 before this path);
- `LoRA` and `int8_weight`: stage 2's host path with an adapter fused or the weights quantized before placing.

`of which NaN/Inf check` is the part of placing spent checking each weight for NaN and Inf on the host
(tpu_video/runtime/placement.py: `holds_nonfinite`), in seconds and as a share of load + place; it also
takes the first touch of the file's pages that the copy to the devices would take otherwise, so
`WEIGHT_LOADING_UNCHECKED=1` (the check left out) gives the side-by-side cost.

`load + place` is the seconds from nothing to every weight on its devices (the model class imported and its
config read before: `raw read` has no imports either). Peak anonymous memory (RssAnon above the process's
start, sampled every 2 ms; the checkpoint's mapped pages are file-backed and not counted) once loaded and
once placed, in GiB: on the CPU the devices' buffers are host memory too, so `placed` includes the weights
once; `loaded` is the peak before anything is placed (loaded, fused or quantized, and stacked for the scan):
what the host holds on top of the devices' copy, wherever the devices are. Cold rows
first drop the files from the page cache (posix_fadvise DONTNEED), so the read comes from the disk; warm rows
read them from the page cache.

    python benchmarks/weight_loading.py [--layers 4] [--devices 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = ("raw read", "direct, unrolled", "direct, scanned", "from_pretrained, unrolled", "from_pretrained, scanned",
         "LoRA, scanned", "int8_weight, scanned")  # fmt: skip


def files_of(folder: Path) -> list[Path]:
    return sorted((folder / "transformer").glob("*.safetensors"))


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages: no root needed)."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def child(folder: str, mode: str, adapter: str) -> dict:
    """One row, in this (fresh) process."""
    import resource
    import threading
    import time

    def anon() -> int:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["RssAnon"].split()[0]) * 1024

    peak, done = [anon()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    import jax
    import torch

    from sharding import MeshShape
    from tpu_video import models
    from tpu_video.engine import lora, scanned_blocks
    from tpu_video.engine.denoise import DenoiseOptions, load_transformers
    from tpu_video.engine.settings import Quantization
    from tpu_video.runtime import placement
    from tpu_video.runtime.interface import Timer
    from tpu_video.workarounds.torchax import import_torchax

    env = import_torchax().default_env()
    checking = [0.0]  # seconds placing spends checking for NaN and Inf (placement.holds_nonfinite), timed here
    holds_nonfinite = placement.holds_nonfinite

    def timed_check(tensor):
        start = time.perf_counter()
        try:
            return False if os.environ.get("WEIGHT_LOADING_UNCHECKED") else holds_nonfinite(tensor)
        finally:
            checking[0] += time.perf_counter() - start

    placement.holds_nonfinite = timed_check
    source, family = models.resolve_model(folder)
    mesh = placement.make_mesh(MeshShape(tp=jax.device_count()))
    source.component_class("transformer")  # imports diffusers' model classes: not loading, and raw read has none
    source.load_config("transformer")
    before = anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    if mode == "raw read":
        for path in files_of(Path(folder)):
            with open(path, "rb") as file:
                file.read()
        placed = loaded = time.perf_counter()
        peak_loaded = peak[0]
    else:
        kind = mode.split(",")[0]
        options = DenoiseOptions()
        if kind == "LoRA":
            adapters = lora.read_adapters([("--lora", adapter)], family, source, torch.bfloat16)
            options = DenoiseOptions(on_loaded=lambda found: lora.fuse(found, adapters, family))
        elif kind == "int8_weight":
            options = DenoiseOptions(quantization=Quantization("int8_weight"))
        if kind == "from_pretrained":
            transformer = source.load("transformer", dtype=torch.bfloat16).eval()
        else:
            transformer = load_transformers(family, source, torch.bfloat16, options, Timer())["transformer"]
        rules = family.transformer_rules("megatron")
        if mode.endswith("scanned"):
            blocks = scanned_blocks.block_list(transformer)
            names = scanned_blocks.BlockScan(transformer, (0, len(blocks)), scan=None).stacked_names()
            rules = rules.with_stacked(set(names))
        loaded = time.perf_counter()
        peak_loaded = peak[0]
        placement.place_module(transformer, rules, mesh, env)
        jax.block_until_ready([tensor.jax() for tensor in transformer.parameters()])
        placed = time.perf_counter()

    done.set()
    thread.join()
    return {
        "load_seconds": loaded - start,
        "place_seconds": placed - loaded,
        "seconds": placed - start,
        "check_seconds": checking[0],
        "peak_anon_loaded_bytes": peak_loaded - before,
        "peak_anon_bytes": peak[0] - before,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_row(folder: Path, mode: str, adapter: Path, devices: int, cold: bool) -> dict:
    if cold:
        evict(files_of(folder))
    else:  # warm: the files in the page cache
        for path in files_of(folder):
            path.read_bytes()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, __file__, "--child", str(folder), mode, str(adapter)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(done.stdout.splitlines()[-1])  # after the log lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices, tp over all (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each row; the median (default: %(default)s)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from lora_memory import build  # benchmarks/lora_memory.py: the model folder and its adapter

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        adapter = build(folder, args.layers, 64)
        file_bytes = sum(path.stat().st_size for path in files_of(folder))
        rows = {}
        for cold in (True, False):
            for mode in MODES:
                runs = [run_row(folder, mode, adapter, args.devices, cold) for _ in range(args.repeats)]
                rows[f"{'cold' if cold else 'warm'}, {mode}"] = {
                    key: statistics.median(run[key] for run in runs) for key in runs[0]
                }
    gib = 2**30
    size = f"{file_bytes / gib:.2f} GiB of bf16 weights ({args.layers} blocks of Wan 14B width)"
    print(f"{size}, {args.devices} device(s)")
    print(
        "| files, path | load s | place s | load + place s | vs raw read | of which NaN/Inf check s "
        "| peak anonymous GiB: loaded, placed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        raw = rows[f"{name.split(',')[0]}, raw read"]["seconds"]
        print(
            f"| {name} | {row['load_seconds']:.2f} | {row['place_seconds']:.2f} | {row['seconds']:.2f} | "
            f"{row['seconds'] / raw:.2f} | {row['check_seconds']:.2f} ({row['check_seconds'] / row['seconds']:.0%}) | "
            f"{row['peak_anon_loaded_bytes'] / gib:.2f}, "
            f"{row['peak_anon_bytes'] / gib:.2f} |"
        )
    print(json.dumps({"layers": args.layers, "devices": args.devices, "file_bytes": file_bytes, "rows": rows}))


if __name__ == "__main__":
    main()
