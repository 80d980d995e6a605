"""Stage 2's start-up, phase by phase, side by side in one run: cold (no compilation cache, no saved
executables), the compilation cache only (filled by a run before), and saved executables (filled by a run
before). Each measured run is a fresh `stage2_transformer.py` process on the same stage-1 folder; the
table shows the `seconds` its config records and the process's wall time. A private cache folder
($TPU_VIDEO_CACHE) keeps the user's caches out of it.

    python benchmarks/time_to_ready.py                              # the tiny presets of every family
    python benchmarks/time_to_ready.py --models tiny-wan2.1 --repeats 3
    python benchmarks/time_to_ready.py --models wan2.1-1.3B-width   # published width, reduced depth
    python benchmarks/time_to_ready.py --models wan2.1-1.3B-width --blocks 30 --scan_blocks off on --modes cold

`wan2.1-1.3B-width` is tiny-wan2.1's pipeline with a random transformer of Wan 2.1 T2V 1.3B's published
width (12 heads x 128, FFN 8960) and 6 of its 30 blocks (`--blocks`), saved with save_pretrained and loaded
through `--model FOLDER` like a real checkpoint, at 64x64, 5 frames, 2 steps. `--scan_blocks` runs every
mode with each of the given settings (the ratio is to the cold run with the first one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny-wan2.1", "tiny-hunyuanvideo15", "tiny-cogvideox")
WIDE = "wan2.1-1.3B-width"
WIDE_BLOCKS = 6
WIDE_REQUEST = ["--height", "64", "--width", "64", "--num_frames", "5", "--num_inference_steps", "2"]
PHASES = ("read", "load", "place", "trace", "compile", "executables", "warmup", "denoise", "other", "total")


def modes(store: Path) -> dict[str, tuple[list[str], bool]]:
    """name: (stage-2 flags, whether a run before the measured ones fills its cache)."""
    return {
        "cold": (["--no_compile_cache", "--executables", "off"], False),
        "compile cache": (["--executables", "off"], True),
        "saved executables": (["--executables", str(store)], True),
    }


def stage(script: str, argv: list, env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, ROOT / script, *map(str, argv)], env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{script} {argv} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def wide_model(folder: Path, blocks: int) -> list[str]:
    """Stage 1's model flags for WIDE, after saving its folder (see the module's docstring)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from diffusers import WanTransformer3DModel

    from tpu_video.models import PRESETS
    from tpu_video.models.wan.published import WAN_13B_TRANSFORMER

    pipe = PRESETS["tiny-wan2.1"].build()
    torch.manual_seed(0)
    config = {**WAN_13B_TRANSFORMER, "text_dim": pipe.transformer.config.text_dim, "num_layers": blocks}
    pipe.transformer = WanTransformer3DModel(**config).eval()
    pipe.save_pretrained(folder)
    return ["--model", str(folder), *WIDE_REQUEST]


def measure(model: str, args, workdir: Path, env: dict) -> dict[str, dict[str, float]]:
    out = workdir / model
    flags = wide_model(workdir / "wide-model", args.blocks) if model == WIDE else ["--model", model]
    stage("stage1_text_encoder.py", [*flags, "--prompt", "a cat", "--output_dir", out], env)
    rows = {}
    for scan in args.scan_blocks:
        for name, (flags, primed) in modes(workdir / f"store-{model}").items():
            if name not in args.modes:
                continue
            flags = [*flags, "--scan_blocks", scan]
            if primed:
                stage("stage2_transformer.py", ["--input_dir", out, *flags], env)
            runs = []
            for _ in range(args.repeats):
                wall = stage("stage2_transformer.py", ["--input_dir", out, *flags], env)
                seconds = json.loads((out / "generation_config.json").read_text())["stage2"]["seconds"]
                runs.append({**{phase: seconds.get(phase, 0.0) for phase in PHASES}, "process": wall})
            label = name if len(args.scan_blocks) == 1 else f"{name}, scan {scan}"
            rows[label] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"tiny presets, or {WIDE}")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per mode (the median is shown)")
    parser.add_argument("--blocks", type=int, default=WIDE_BLOCKS, help=f"{WIDE}'s depth (default: %(default)s)")
    parser.add_argument("--scan_blocks", nargs="+", default=["auto"], help="stage 2's settings to compare")
    names = list(modes(Path()))
    parser.add_argument("--modes", nargs="+", choices=names, default=names, help="which starts to measure")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "TPU_VIDEO_CACHE": str(Path(workdir) / "cache")}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        for model in args.models:
            results[model] = measure(model, args, Path(workdir), env)
    columns = (*PHASES, "process")
    print("| model | start | " + " | ".join(columns) + " | trace+compile+executables vs cold |")
    print("|---|---|" + "---:|" * (len(columns) + 1))
    for model, rows in results.items():
        first = rows[next(iter(rows))]
        cold = first["trace"] + first["compile"]
        for name, row in rows.items():
            building = row["trace"] + row["compile"] + row["executables"]
            cells = " | ".join(f"{row[key]:.2f}" for key in columns)
            print(f"| {model} | {name} | {cells} | {building / cold:.2f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
