"""The default mesh's activation estimate (runtime.mesh.Activations: each family's fitted copies of a
sample's hidden states) against the TPU compiler's temporaries, for published models at their documented
sizes on several meshes of a v6e-8. Prints a markdown table and one JSON line at the end; the measured
rows are what tests/test_mesh.py::MEASURED_TEMPORARIES holds.

Each row is `stage2_transformer.py --plan v6e-8 ...` in its own process (benchmarks/tpu_plan.py's
runner); on 2 CPU cores a row takes 2-5 minutes.

    python benchmarks/activation_estimate.py              # every row
    python benchmarks/activation_estimate.py --only Wan   # the rows whose label contains "Wan"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

WAN13 = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN14 = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
TI2V = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
HUNYUAN = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
COGVIDEOX = "zai-org/CogVideoX1.5-5B"
TI2V_CARD = {"height": 704, "width": 1280, "num_frames": 121}  # the model card's size

# (label, model, request flags, mesh (dp, sp, tp); None: the default)
ROWS = [
    ("Wan2.1-1.3B 480p", WAN13, {}, None),
    ("Wan2.1-1.3B 480p", WAN13, {}, (2, 4, 1)),
    ("Wan2.1-1.3B 480p", WAN13, {}, (1, 2, 4)),
    ("Wan2.1-1.3B 480p", WAN13, {}, (2, 2, 2)),
    ("Wan2.1-14B 480p", WAN14, {}, None),
    ("Wan2.1-14B 720p", WAN14, {"height": 720, "width": 1280}, None),
    ("Wan2.2-TI2V-5B 480x832x81", TI2V, {}, None),
    ("Wan2.2-TI2V-5B 704x1280x121", TI2V, TI2V_CARD, None),
    ("Wan2.2-TI2V-5B 704x1280x121", TI2V, TI2V_CARD, (2, 4, 1)),
    ("HunyuanVideo-1.5 480p", HUNYUAN, {}, None),
    ("HunyuanVideo-1.5 480p", HUNYUAN, {}, (2, 4, 1)),
    ("HunyuanVideo-1.5 720p", HUNYUAN.replace("480p", "720p"), {}, None),
    ("CogVideoX1.5-5B", COGVIDEOX, {}, None),
    ("CogVideoX1.5-5B", COGVIDEOX, {}, (2, 4, 1)),
]


def estimate(model: str, flags: dict, mesh: dict) -> tuple[int, int]:
    """The video tokens and estimated activation bytes per device of one sample per CFG branch on `mesh`."""
    from tpu_video.cli import parse_dtype
    from tpu_video.engine.meta import model_facts
    from tpu_video.planning.flags import default_request

    request, source, family = default_request(model, flags)
    facts = model_facts(family, source, parse_dtype(request.dtype), "megatron", request)
    samples = 2 // mesh["dp"]  # one video, two CFG branches
    return facts.activations.tokens, facts.activations.bytes_per_device(samples, mesh["sp"], mesh["tp"])


def command(model: str, flags: dict, mesh) -> list[str]:
    argv = ["stage2_transformer.py", "--model", model, "--plan", "v6e-8"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    for axis, size in zip(("dp", "sp", "tp"), mesh or (), strict=False):
        argv += [f"--{axis}", str(size)]
    return argv


def main() -> None:
    from tpu_plan import run_row

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run only the rows whose label contains this text")
    args = parser.parse_args()
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for label, model, flags, mesh in ROWS:
            if args.only and args.only not in label:
                continue
            row = run_row(label, command(model, flags, mesh), Path(folder))
            if "error" not in row:
                tokens, estimated = estimate(model, flags, row["mesh"])
                row = {"label": label, "mesh": row["mesh"], "tokens": tokens, "estimated": estimated, **row}
            results.append(row)
            print(
                json.dumps({k: v for k, v in row.items() if k not in ("collectives", "splash_padding")}),
                file=sys.stderr,
            )
    gib = 2**30
    columns = ("model, size", "mesh dp x sp x tp", "video tokens", "compiler temporaries GiB", "estimate GiB")
    print("| " + " | ".join(columns) + " | estimate / compiler |")
    print("|---|---|---|---|---|---|")
    for row in results:
        if "error" in row:
            print(f"| {row['label']} | error: {row['error'][:80]} | | | | |")
            continue
        mesh = "x".join(str(size) for size in row["mesh"].values())
        temporaries = row["hbm_bytes_per_device"]["temporaries"]
        ratio = row["estimated"] / temporaries
        print(
            f"| {row['label']} | {mesh} | {row['tokens']} | {temporaries / gib:.2f} | "
            f"{row['estimated'] / gib:.2f} | {ratio:.2f} |"
        )
    minutes = (time.perf_counter() - start) / 60
    print(f"\n{len(results)} rows in {minutes:.1f} minutes", flush=True)
    print(json.dumps({"rows": results, "minutes": round(minutes, 1)}))


if __name__ == "__main__":
    main()
