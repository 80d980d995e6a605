#!/usr/bin/env python
"""Many videos per stage-2 run, side by side in one run on this host: N tiny videos as N stage-2 processes
(one folder each, what a shell loop does) against one process denoising them as a batch
(`--input_dir BATCH --batch_size N`), total wall time each and the ratio, videos per hour, and whether the
latents agree (1e-5 relative, fp32). With `--plans TPU` it also compiles CogVideoX1.5-5B's step for the
TPU at batch 1 on 2x1x4 and batch 4 on 8x1x1 and 4x1x2 (HBM, collectives per block, per-video step bound).

    python benchmarks/batch_throughput.py [--model tiny-cogvideox] [--videos 6] [--steps 4]
    python benchmarks/batch_throughput.py --plans v6e-8
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANS = {"batch 1 at 2x1x4": (1, (2, 1, 4)), "batch 4 at 8x1x1": (4, (8, 1, 1)), "batch 4 at 4x1x2": (4, (4, 1, 2))}


def stage(script: str, *argv, allowed=(0,)) -> float:
    """Run a stage as its own process (exit status in `allowed`); its wall time in seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / script), *map(str, argv)], capture_output=True, text=True)
    if done.returncode not in allowed:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def cpu_side_by_side(model: str, videos: int, steps: int) -> dict:
    import torch

    from tpu_video.engine import batch_folders
    from utils import read_config, read_tensors

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batch"
        seeds = f"1-{videos}"
        stage("stage1_text_encoder.py", "--model", model, "--prompt", "a cat", "--seeds", seeds, "--output_dir", folder)
        separate = Path(tmp) / "separate"
        shutil.copytree(folder, separate)
        flags = ["--num_inference_steps", steps, "--dtype", "fp32"]
        alone = sum(
            stage("stage2_transformer.py", "--input_dir", f, *flags) for f in batch_folders.expand_folders([separate])
        )
        together = stage("stage2_transformer.py", "--input_dir", folder, "--batch_size", videos, *flags)
        errors = []
        for a, b in zip(batch_folders.expand_folders([folder]), batch_folders.expand_folders([separate]), strict=True):
            x, y = (read_tensors(f, read_config(f)["stage2"])["latents"] for f in (a, b))
            errors.append(((x - y).norm() / y.norm()).item())
    return {
        "model": model,
        "videos": videos,
        "steps": steps,
        "separate_processes_seconds": round(alone, 2),
        "one_batched_process_seconds": round(together, 2),
        "ratio_batched_over_separate": round(together / alone, 3),
        "videos_per_hour": {"separate": round(3600 * videos / alone), "batched": round(3600 * videos / together)},
        "max_relative_error": max(errors),
        "within_1e-5": max(errors) <= 1e-5 and bool(torch.tensor(errors).isfinite().all()),
    }


def tpu_plans(target: str) -> dict:
    """CogVideoX1.5-5B's step compiled for `target` at each batch and mesh of PLANS (--plan_json each)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (videos, (dp, sp, tp)) in PLANS.items():
            out = Path(tmp) / "plan.json"
            argv = ["--plan", target, "--model", "zai-org/CogVideoX1.5-5B", "--input_dir", tmp, "--plan_json", out]
            argv += ["--batch_size", videos, "--dp", dp, "--sp", sp, "--tp", tp]
            seconds = stage("stage2_transformer.py", *argv, allowed=(0, 3))  # 3: does not fit
            report = json.loads(out.read_text())
            per_block = report.get("collectives", {}).get("per_block", {})
            results[name] = {
                "fits": report["fits"],
                "hbm_gib_per_device": round(report["hbm_bytes_per_device"]["total"] / 2**30, 2),
                "collectives_per_block": {op: v["bytes"] for op, v in per_block.items()},
                "step_seconds_lower_bound_per_video": report.get("step_seconds_lower_bound_per_video"),
                "compile_seconds": round(seconds, 1),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-cogvideox", help="a tiny preset (default: %(default)s)")
    parser.add_argument("--videos", type=int, default=6, help="videos, one seed each (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument("--plans", metavar="TPU", help="also compile CogVideoX1.5-5B's batches for this TPU")
    args = parser.parse_args()
    result = {"cpu": cpu_side_by_side(args.model, args.videos, args.steps)}
    cpu = result["cpu"]
    print(f"{args.videos} {args.model} videos, {args.steps} steps, one CPU device:")
    print(f"  {args.videos} stage-2 processes: {cpu['separate_processes_seconds']} s")
    print(f"  one process, --batch_size {args.videos}: {cpu['one_batched_process_seconds']} s")
    print(f"  ratio {cpu['ratio_batched_over_separate']}; latents within 1e-5: {cpu['within_1e-5']}")
    if args.plans:
        result["tpu"] = tpu_plans(args.plans)
        for name, plan in result["tpu"].items():
            print(f"  {args.plans} {name}: {plan}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
