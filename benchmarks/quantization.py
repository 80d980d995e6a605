#!/usr/bin/env python
"""`--quantize`: what each scheme does to the latents, and the host memory of quantizing; a table and one JSON
line per part.

quality: every family's tiny preset, stage 1 once, then stage 2 (fp32, one CPU device) unquantized and with
each scheme and layer set; the relative error of each run's final latents against the unquantized run's
(LTX-2: the video's, and the audio's in rows of their own).

memory: a Wan 2.1 14B-width transformer (the published config) with `--layers` blocks and random bf16 weights,
saved as a model folder, loaded in a fresh process as stage 2 loads it, then quantized as stage 2 quantizes
it. from_pretrained maps the checkpoint, so its pages count as the process's file-backed memory once read;
the anonymous memory (what the process allocates) is sampled every 2 ms while quantizing, as the kernel keeps
no peak of it; the peak resident memory (ru_maxrss) counts both. All against the bf16 weights' bytes.

hbm: `--plan` (the TPU compiler, on this host) of published models at 720p, bf16 and `--quantize int8_weight`
side by side: HBM per device (the weights are the plan's `arguments`), temporaries, the verdict.

    python benchmarks/quantization.py [--parts quality memory hbm] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

PRESETS = ("tiny-wan2.1", "tiny-cogvideox", "tiny-hunyuanvideo15", "tiny-ltx2", "tiny-ltx2.3")
STREAMS = {"tiny-ltx2": ("latents", "audio_latents"), "tiny-ltx2.3": ("latents", "audio_latents")}
SCHEMES = ("int8_weight", "int8", "fp8_weight")
LAYER_SETS = ("all", "ffn", "attention")


def stage(module, argv) -> None:
    from tpu_video.cli import run_cli

    run_cli(lambda: module.main([str(arg) for arg in argv]))


def latents(folder: Path, name: str = "latents"):
    from utils import read_config, read_tensors

    return read_tensors(folder, read_config(folder, needs="stage2")["stage2"])[name].double()


def row_names(preset: str) -> list[tuple[str, str]]:
    """(row label, stage-2 tensor) for each stream the preset denoises."""
    return [(preset if name == "latents" else f"{preset} audio", name) for name in STREAMS.get(preset, ("latents",))]


def quality(work: Path) -> dict:
    import stage1_text_encoder
    import stage2_transformer
    from tpu_video.cli import set_logging

    set_logging(False)
    results = {}
    for preset in PRESETS:
        first = work / preset / "stage1"
        stage(stage1_text_encoder, ["--model", preset, "--prompt", "a cat playing guitar", "--dtype", "fp32",
                                    "--output_dir", first])  # fmt: skip
        none = work / preset / "none"  # --executables off: tiny-preset programs kept out of the user's store
        stage(stage2_transformer, ["--input_dir", first, "--output_dir", none, "--executables", "off"])
        for scheme in SCHEMES:
            for layers in LAYER_SETS:
                out = work / preset / f"{scheme}-{layers}"
                stage(stage2_transformer, ["--input_dir", first, "--output_dir", out, "--quantize", scheme,
                                           "--quantize_layers", layers, "--executables", "off"])  # fmt: skip
                for label, name in row_names(preset):
                    base = latents(work / preset / "none", name)
                    results[f"{label} {scheme} {layers}"] = ((latents(out, name) - base).norm() / base.norm()).item()
    return results


MEMORY_CHILD = r"""
import json, resource, sys, threading, time, torch
from tpu_video import models
from tpu_video.engine.quantize import quantize
from tpu_video.engine.settings import Quantization

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}

peaks, done = {"RssAnon": 0, "RssFile": 0}, threading.Event()
def sample():  # the kernel keeps no peak per kind: sample every 2 ms
    while not done.is_set():
        for key, value in status().items():
            peaks[key] = max(peaks[key], value)
        time.sleep(0.002)

before = status()
source, _ = models.resolve_model(sys.argv[1])
transformer = source.load("transformer", dtype=torch.bfloat16)
weights = sum(p.numel() * p.element_size() for p in transformer.parameters())
loaded, loaded_peak = status(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
thread = threading.Thread(target=sample)
thread.start()
quantize({"transformer": transformer}, Quantization(sys.argv[2]))
done.set()
thread.join()
after = sum(p.numel() * p.element_size() for p in transformer.parameters())
print(json.dumps({"before": before, "loaded": loaded, "loaded_peak": loaded_peak, "quantizing_peaks": peaks,
                  "quantized_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "weights": weights, "weights_after": after}))
"""


def memory(work: Path, layers: int) -> dict:
    from lora_memory import wide_wan  # benchmarks/lora_memory.py, beside this file

    folder = work / "wan14b-width"
    wide_wan(folder, layers)  # the returned module is dropped here: the children load the saved folder
    results = {}
    for scheme in SCHEMES[:1] + SCHEMES[2:]:  # int8 stores what int8_weight stores
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(folder), scheme], env=env, cwd=ROOT,
                              capture_output=True, text=True, check=True)  # fmt: skip
        results[scheme] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


PLANS = [  # (model, height, width, frames, target)
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 720, 1280, 81, "v6e-8"),
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 720, 1280, 81, "v5e-8"),
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 720, 1280, 81, "v6e-8"),
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 720, 1280, 81, "v5e-8"),
    ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v", 720, 1280, 121, "v5e-8"),
]


def hbm(work: Path) -> dict:
    results = {}
    for model, height, width, frames, target in PLANS:
        for scheme in ("none", "int8_weight"):
            report = work / f"plan-{len(results)}.json"
            argv = ["--plan", target, "--model", model, "--height", height, "--width", width, "--num_frames", frames]
            argv += ["--quantize", scheme, "--plan_json", report]
            done = subprocess.run([sys.executable, str(ROOT / "stage2_transformer.py"), *map(str, argv)], cwd=ROOT,
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode not in (0, 3):  # 3: does not fit
                raise RuntimeError(done.stderr[-2000:])
            found = json.loads(report.read_text())
            results[f"{model} {target} {scheme}"] = {
                "mesh": found["mesh"],
                "fits": found["fits"],
                "hbm": found["hbm_bytes_per_device"],
                "compile_seconds": found["compile_seconds"],
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = ("quality", "memory", "hbm")
    parser.add_argument("--parts", nargs="+", choices=parts, default=list(parts))
    parser.add_argument("--layers", type=int, default=4, help="memory: blocks of the 14B-width transformer")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if "quality" in args.parts:
            found = quality(work)
            print(f"{'preset':22} {'scheme':12} " + " ".join(f"{layers:>10}" for layers in LAYER_SETS))
            for label, _ in (row for preset in PRESETS for row in row_names(preset)):
                for scheme in SCHEMES:
                    row = " ".join(f"{found[f'{label} {scheme} {layers}']:10.2e}" for layers in LAYER_SETS)
                    print(f"{label:22} {scheme:12} {row}")
            print(json.dumps({"quality": found}))
        if "memory" in args.parts:
            found = memory(work, args.layers)
            gib = 2**30
            for scheme, row in found.items():
                anon, file = row["quantizing_peaks"]["RssAnon"], row["quantizing_peaks"]["RssFile"]
                base = row["before"]["RssAnon"]
                print(
                    f"{scheme}: bf16 weights {row['weights'] / gib:.2f} GiB -> {row['weights_after'] / gib:.2f} GiB; "
                    f"loaded: anonymous {row['loaded']['RssAnon'] / gib:.2f} GiB, "
                    f"file {row['loaded']['RssFile'] / gib:.2f} GiB (the checkpoint is mapped, read as touched); "
                    f"quantizing, peaks: anonymous {anon / gib:.2f} GiB"
                    f" ((peak - before loading) / bf16 weights = {(anon - base) / row['weights']:.3f}), file "
                    f"{file / gib:.2f} GiB; peak resident (ru_maxrss) {row['quantized_peak'] / gib:.2f} GiB "
                    f"= {row['quantized_peak'] / row['weights']:.3f} x the bf16 weights"
                )
            print(json.dumps({"memory": found}))
        if "hbm" in args.parts:
            found = hbm(work)
            gib = 2**30
            for case, row in found.items():
                sizes = {key: f"{value / gib:.2f}" for key, value in row["hbm"].items()}
                print(f"{case}: mesh {row['mesh']}, fits {row['fits']}, GiB per device {sizes}")
            print(json.dumps({"hbm": found}))


if __name__ == "__main__":
    main()
