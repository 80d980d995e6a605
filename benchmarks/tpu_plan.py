"""A grid of --plan runs on the real TPU compiler (libtpu, no TPU needed): which configurations fit, and
what each costs in HBM, collectives and FLOPs. Prints a markdown table and one JSON line at the end.

Each row is `stage2_transformer.py --plan ...` (or stage 3's) in its own process, from the published
configs kept in code (no weights, no network). One stage-2 row compiles the full model plus two short
copies (2 and 3 blocks, for the per-block collectives); on 2 CPU cores a full model takes 1.5-2.5 minutes.

    python benchmarks/tpu_plan.py                 # the whole grid (18 rows)
    python benchmarks/tpu_plan.py --rows 3        # the first rows only
    python benchmarks/tpu_plan.py --only Wan      # the rows whose label contains "Wan"
    python benchmarks/tpu_plan.py --tiles         # Splash alone: which tiles compile on which generation
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COGVIDEOX = "zai-org/CogVideoX1.5-5B"  # 768 x 1360 x 81 by default
HUNYUAN = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"  # 720 x 1280 x 121 by default
WAN = {"Wan2.1-14B": "Wan-AI/Wan2.1-T2V-14B-Diffusers", "Wan2.2-A14B": "Wan-AI/Wan2.2-T2V-A14B-Diffusers"}
WAN_VIDEOS = {"720p": ("720", "1280"), "480p": ("480", "832")}  # 81 frames, the pipeline's default
TILES = {"3328/2816/256": (3328, 2816, 256), "2048/2048/1024": (2048, 2048, 1024), "512/512/512": (512, 512, 512)}


def grid() -> list[tuple[str, list[str]]]:
    """(label, stage script + flags) rows: default meshes on four generations, then v6e-8 variants and
    the 720p decode."""
    rows = []
    for tpu in ("v6e-8", "v5e-8", "v5p-8", "tpu7x-8"):
        rows.append((f"CogVideoX1.5-5B {tpu}", ["stage2_transformer.py", "--model", COGVIDEOX, "--plan", tpu]))
        rows.append((f"HunyuanVideo-1.5 720p {tpu}", ["stage2_transformer.py", "--model", HUNYUAN, "--plan", tpu]))
    decode = ["stage3_vae_decoder.py", "--model", HUNYUAN, "--plan", "v6e-8"]
    rows.append(("HunyuanVideo-1.5 720p decode v6e-8", decode))
    rows.append(("HunyuanVideo-1.5 720p decode v6e-8 tiling", [*decode, "--tiling"]))
    base = ["stage2_transformer.py", "--model", COGVIDEOX, "--plan", "v6e-8"]
    rows.append(("CogVideoX1.5-5B v6e-8 1x1x8", [*base, "--dp", "1", "--tp", "8"]))
    for name, (block_q, block_kv, compute) in TILES.items():
        if name != "3328/2816/256":  # CogVideoX's default, the first row
            tiles = ["--block_q", str(block_q), "--block_kv", str(block_kv), "--block_kv_compute", str(compute)]
            rows.append((f"CogVideoX1.5-5B v6e-8 tiles {name}", [*base, *tiles]))
    rows.append(("CogVideoX1.5-5B v6e-8 replicated_out", [*base, "--tp_mode", "replicated_out"]))
    for name, model in WAN.items():
        for video, (height, width) in WAN_VIDEOS.items():
            flags = ["--model", model, "--plan", "v6e-8", "--height", height, "--width", width, "--num_frames", "81"]
            rows.append((f"{name} {video} v6e-8", ["stage2_transformer.py", *flags]))
    return rows


def run_row(label: str, command: list[str], folder: Path) -> dict:
    out = folder / f"{len(list(folder.iterdir()))}.json"
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / command[0]),
            "--input_dir",
            str(folder / "none"),
            *command[1:],
            "--plan_json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if result.returncode not in (0, 3) or not out.is_file():
        tail = (result.stderr.strip().splitlines() or ["?"])[-1]
        return {"label": label, "error": tail, "wall_seconds": round(seconds, 1)}
    return {"label": label, "wall_seconds": round(seconds, 1), **json.loads(out.read_text())}


def table_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['label']} | error: {row['error'][:80]} | | | | | |"
    gib = 2**30
    memory = row["hbm_bytes_per_device"]
    mesh = "x".join(str(size) for size in row["mesh"].values())
    verdict = "fits" if row["fits"] else "**does not fit**"
    hbm = f"{memory['total'] / gib:.2f} / {memory['capacity'] / gib:.0f}"
    if "per_block" in row.get("collectives", {}):
        found = row["collectives"]["per_block"]
        collectives = ", ".join(f"{v['tensors']} {op}" for op, v in found.items()) or "none"
    elif "collectives" in row:
        collectives = ", ".join(f"{v['tensors']} {op}" for op, v in row["collectives"]["total"].items()) or "none"
    else:
        collectives = ""
    bound = row.get("step_seconds_lower_bound", row.get("decode_seconds_lower_bound"))
    bound = f"{bound:.2f}" if bound is not None else ""
    padding = ", ".join(f"{p['q_padding_percent']}%" for p in row.get("splash_padding", [])[:1])
    return f"| {row['label']} | {mesh} | {verdict} | {hbm} | {collectives} | {bound} | {padding} |"


# The two models' attention at the default mesh 2x1x4: (batch, heads, tokens, head_dim).
ATTENTION_SHAPES = {"CogVideoX1.5-5B": (2, 48, 45106, 64), "HunyuanVideo-1.5 720p": (2, 16, 113585, 128)}


def splash_tiles() -> list[dict]:
    """Compile the Splash kernel alone (bf16, exact masking, 2x1x4 mesh) for every generation and tile
    candidate: seconds each, where the full model takes minutes. A kernel whose blocks overflow the
    core's scoped VMEM is refused by the compiler with the sizes, which are recorded."""
    import re

    sys.path.insert(0, str(ROOT))
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import sharding
    from splash_attention import splash_attention
    from tpu_video.attention.plan import SplashConfig
    from tpu_video.planning import tpus

    found = []
    for tpu in ("v5e-8", "v5p-8", "v6e-8", "tpu7x-8"):
        target = tpus.parse_target(tpu)
        mesh = tpus.topology_mesh(target, sharding.MeshShape(2, 1, target.devices // 2))
        for model, (batch, heads, tokens, head_dim) in ATTENTION_SHAPES.items():
            for name, tiles in {**TILES, "1024/1024/512": (1024, 1024, 512)}.items():  # + the v5e/v5p cap
                config = SplashConfig(*tiles)
                qkv = jax.ShapeDtypeStruct(
                    (batch, heads, tokens, head_dim), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P("dp", "tp"))
                )
                valid = jax.ShapeDtypeStruct((batch, tokens), jax.numpy.bool_, sharding=NamedSharding(mesh, P("dp")))

                def attend(q, k, v, key_valid, config=config, mesh=mesh):
                    return splash_attention(q, k, v, key_valid, config=config, mesh=mesh)

                try:
                    jax.jit(attend).lower(qkv, qkv, qkv, valid).compile()
                    result = "compiles"
                except jax.errors.JaxRuntimeError as err:
                    sizes = re.search(r"Scoped allocation with size ([\d.]+M) and limit ([\d.]+M)", str(err))
                    if sizes is None:
                        raise
                    result = f"needs {sizes.group(1)}iB of scoped VMEM, limit {sizes.group(2)}iB"
                found.append({"tpu": tpu, "model": model, "tiles": name, "result": result})
                print(json.dumps(found[-1]), file=sys.stderr, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help="run only the first N rows")
    parser.add_argument("--only", help="run only the rows whose label contains this text")
    parser.add_argument("--tiles", action="store_true", help="only compile Splash alone for each tile candidate")
    args = parser.parse_args()
    if args.tiles:
        found = splash_tiles()
        print("| TPU | model | tiles | Splash kernel |\n|---|---|---|---|")
        for row in found:
            print(f"| {row['tpu']} | {row['model']} | {row['tiles']} | {row['result']} |")
        print(json.dumps({"tiles": found}))
        return
    rows = [row for row in grid() if args.only is None or args.only in row[0]][: args.rows]
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for label, command in rows:
            results.append(run_row(label, command, Path(folder)))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # each row as it finishes
    print(
        "| configuration | mesh dp x sp x tp | verdict | HBM GiB per device (used / has) | "
        "collectives per block (tensors) | step s, lower bound | Splash q padding |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in results:
        print(table_row(row))
    minutes = (time.perf_counter() - start) / 60
    print(f"\n{len(results)} rows in {minutes:.1f} minutes", flush=True)
    print(json.dumps({"rows": results, "minutes": round(minutes, 1)}))


if __name__ == "__main__":
    main()
