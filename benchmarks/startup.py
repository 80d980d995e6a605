"""How soon a stage answers, side by side for several checkouts in one run: `--help` of each stage, a flag's
error, and a stage-1 run of a tiny preset (seconds to its first output line, to its line naming the family,
and to its end). Each measurement is a fresh process of the checkout's own stage script with this Python;
the median of `--repeats` runs. A private cache folder ($TPU_VIDEO_CACHE), filled by one run before the
measured ones, keeps the preset's first build out of the figures.

    python benchmarks/startup.py                                    # this checkout
    git worktree add /tmp/before HEAD~1 && python benchmarks/startup.py --trees /tmp/before .
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = ("stage1_text_encoder.py", "stage2_transformer.py", "stage3_vae_decoder.py")
PRESET_RUN = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--num_inference_steps", "1"]


def timed(tree: Path, argv: list[str], env: dict[str, str], marker: str | None = None) -> tuple[float, ...]:
    """(seconds to the first output line, to the first line holding `marker`, to the end) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-u", str(tree / argv[0]), *argv[1:]],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = seen = None
    for line in process.stdout:
        now = time.perf_counter() - start
        first = now if first is None else first
        if seen is None and marker is not None and marker in line:
            seen = now
    process.wait()
    return first or 0.0, seen or 0.0, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare (default: this one)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "TPU_VIDEO_CACHE": str(Path(scratch) / "cache")}
        out = Path(scratch) / "out"
        trees = [Path(tree).resolve() for tree in args.trees]
        for tree in trees:  # builds the preset into the cache (each checkout's, should their builds differ)
            timed(tree, ["stage1_text_encoder.py", *PRESET_RUN, "--output_dir", str(out)], env)
        print(f"{'checkout':40} {'what':32} {'first line s':>12} {'named s':>9} {'end s':>7}")
        for tree in trees:
            rows = [([script, "--help"], None) for script in SCRIPTS]
            rows.append((["stage2_transformer.py", "--no_such_flag"], None))
            rows.append((["stage1_text_encoder.py", *PRESET_RUN, "--output_dir", str(out)], "stage 1 for cogvideox"))
            for argv, marker in rows:
                runs = [timed(tree, argv, env, marker) for _ in range(args.repeats)]
                first, named, end = (statistics.median(run[i] for run in runs) for i in range(3))
                what = f"{argv[0].split('_')[0]} {argv[1] if len(argv) == 2 else 'run tiny-cogvideox'}"
                print(f"{str(tree)[-40:]:40} {what:32} {first:12.2f} {named:9.2f} {end:7.2f}", flush=True)


if __name__ == "__main__":
    main()
