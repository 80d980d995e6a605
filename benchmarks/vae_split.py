#!/usr/bin/env python
"""Stage 3's spatial split compared on the real TPU compiler (libtpu, no TPU needed): the frame programs
with the latents split along width over all devices (the default) against height x width on a 2D mesh
(height over `rows`, width over the rest), each compiled in its own process. Prints HBM per program,
collectives per steady call and compile seconds, and one JSON line.

    python benchmarks/vae_split.py [--model Wan-AI/Wan2.1-T2V-14B-Diffusers] [--tpu v6e-8] [--rows 2]
        [--height 720] [--width 1280] [--num_frames 81]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compile_split(model: str, tpu: str, rows: int, size: dict) -> dict:
    """One plan of the family's frame programs with `rows` height rows (1: the default width split)."""
    import torch

    from tpu_video.models import resolve_model
    from tpu_video.planning import flags, plan
    from utils import Request

    source, family = resolve_model(model, configs_only=True)
    values = {**family.request_defaults(source), "seed": 0, **size}
    fixed = {"model_family": family.NAME, "model_id": model, "prompt": "", "negative_prompt": "", "dtype": "bf16"}
    request = Request.from_values({**fixed, **values})  # the family's options among the defaults
    target = flags.target_from_flag(tpu)
    start = time.perf_counter()
    report = plan.plan_stage3(family, source, request, torch.bfloat16, target, False, family.CHUNK_FRAMES[0], rows)
    return {
        "split": report["split"],
        "fits": report["fits"],
        "hbm_gib_per_program": {k: round(v / 2**30, 2) for k, v in report.get("hbm_bytes_per_program", {}).items()},
        "collectives_per_steady_call": report.get("collectives", {}).get("per_steady_call"),
        "decode_seconds_lower_bound": report.get("decode_seconds_lower_bound"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Wan-AI/Wan2.1-T2V-14B-Diffusers", help="default: %(default)s")
    parser.add_argument("--tpu", default="v6e-8", help="default: %(default)s")
    parser.add_argument("--rows", type=int, default=2, help="height rows of the 2D split (default: %(default)s)")
    for name, default in (("height", 720), ("width", 1280), ("num_frames", 81)):
        parser.add_argument(f"--{name}", type=int, default=default, help="default: %(default)s")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = {"height": args.height, "width": args.width, "num_frames": args.num_frames}
    if args.child is not None:
        print(json.dumps(compile_split(args.model, args.tpu, args.child, size)))
        return
    import subprocess

    results = {}
    for rows in (1, args.rows):
        command = [sys.executable, __file__, "--model", args.model, "--tpu", args.tpu, "--child", str(rows)]
        command += [f"--{k}={v}" for k, v in size.items()]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        results[rows] = json.loads(done.stdout.splitlines()[-1])
        print(f"{results[rows]['split']}: {results[rows]}", flush=True)
    print(json.dumps({"model": args.model, "tpu": args.tpu, **size, "results": results}))


if __name__ == "__main__":
    main()
