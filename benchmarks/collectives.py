"""Collectives per transformer block at real widths, read from the compiled HLO on an 8-device mesh.

Builds each family's published transformer at one block (CogVideoX1.5-5B, HunyuanVideo-1.5, Wan 2.1 14B:
`Family.published_block`) on the meta device (no weights, no download), with the attention processors stage
2 installs, compiles the block with abstract (shape-only) weights and inputs placed by the family's rule
table, and counts the collectives XLA inserted (tpu_video/planning/hlo.py). Prints one JSON line per
(model, tp_mode). LTX-2 writes no such block: `--plan` reports its per-block collectives.

Stage 1's text encoders (T5-XXL v1.1 at 226 tokens, the Qwen2.5-VL-7B text model at 1108) are measured
on stage 1's mesh (every device on `tp`): the whole encoder compiled at 1 and at 2 layers, so the
difference is one layer's cost and the rest is the embedding and final norm.

    python benchmarks/collectives.py                      # 8 virtual CPU devices, mesh dp=2 sp=1 tp=4
    python benchmarks/collectives.py --dp 1 --tp 8 --video_tokens 8192
    python benchmarks/collectives.py --models t5-xxl qwen2.5-vl-7b
    python benchmarks/collectives.py --dp 1 --sp 2 --tp 4 --sp_mode gather --tp_mode megatron

Bytes scale linearly with --video_tokens; counts do not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpu_video.attention.sp_modes import SP_MODES  # noqa: E402  (plain strings: no JAX imported yet)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--video_tokens", type=int, default=4096, help="image-stream tokens (default: %(default)s)")
    parser.add_argument("--attention", choices=("xla", "splash"), default="xla")
    parser.add_argument("--sp_mode", choices=SP_MODES, default="auto")
    parser.add_argument("--tp_mode", choices=("megatron", "replicated_out"), help="default: both")
    parser.add_argument(
        "--models",
        nargs="+",
        help="families (their published block: cogvideox, hunyuanvideo15, wan) and stage 1's text encoders "
        "(t5-xxl, qwen2.5-vl-7b) (default: all)",
    )
    args = parser.parse_args()

    # 8 virtual CPU devices unless a platform is chosen; set before JAX is imported.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import sharding
    from tpu_video.planning import hlo
    from tpu_video.runtime import placement

    known = (*hlo.measured_families(), *hlo.TEXT_ENCODERS)
    unknown = [name for name in args.models or () if name not in known]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(known)})")
    mesh = placement.make_mesh(sharding.MeshShape(args.dp, args.sp, args.tp))
    for model_name in args.models or known:
        if model_name in hlo.TEXT_ENCODERS:  # stage 1's mesh: every device on tp
            stage1_mesh = placement.make_mesh(sharding.MeshShape(tp=jax.device_count()))
            print(json.dumps(hlo.measure_text_encoder(model_name, stage1_mesh)), flush=True)
            continue
        for tp_mode in [args.tp_mode] if args.tp_mode else sharding.TP_MODES:
            found = hlo.measure(model_name, tp_mode, mesh, args.video_tokens, args.attention, args.sp_mode)
            print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
