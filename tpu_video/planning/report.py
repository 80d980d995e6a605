"""Printing and saving a `--plan` report (plan.py builds it): a few plain lines, the JSON file, the exit
status that says whether it fits."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from tpu_video.planning.tpus import GIB
from utils import atomic_write, strict_json

DOES_NOT_FIT_EXIT_STATUS = 3
STAGE_WORK = {1: "encode", 2: "step", 3: "decode"}  # what each stage's plan bounds the time of (else its "work")


def finish(report: dict[str, Any], json_path: str | None, store=None) -> None:
    """Record what `store` (the plan's --save_executables, or None) saved, print the report, save it as JSON if
    asked, and exit 3 when it does not fit; a save that was asked for and failed is an error (exit 2)."""
    if store is not None:
        report["executables"] = {"folder": str(store.directory), **store.counts}
    print_report(report)
    if json_path:
        atomic_write(Path(json_path), lambda tmp: tmp.write_text(strict_json(report, indent=2) + "\n"))
    if store is not None and store.counts["failed"]:
        raise UserError(
            f"--save_executables {store.directory}: {store.counts['failed']} program(s) could not be saved (see the "
            "lines above: a full disk?); the plan is above, the folder is incomplete"
        )
    if not report["fits"]:
        sys.exit(DOES_NOT_FIT_EXIT_STATUS)


def print_report(report: dict[str, Any]) -> None:
    """The plan as a few plain lines."""

    def gib(value: float) -> str:
        return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"

    mesh = " ".join(f"{axis}={size}" for axis, size in report["mesh"].items())
    crossing = ", ".join(report["axes_across_hosts"]) or "none"
    print(
        f"plan: stage {report['stage']} of {report['model']} on {report['target']} ({report['topology']}): "
        f"{report['chips']} chips, {report['devices']} devices, {report['hosts']} host(s); mesh {mesh} "
        f"(axes across hosts: {crossing})"
    )
    print(f"  compiled by the TPU compiler in {report['compile_seconds']} s")
    saved = report.get("executables")
    if saved:
        folder = saved["folder"]
        print(f"  saved {saved['saved']} program(s) in {folder}: copy it to the TPU VM, run with --executables DIR")
    if "upsample" in report:
        found = report["upsample"]
        print(
            f"  --upsample: {found['upsampler']} ({found['mid_channels']} middle channels), float32, the first pass's "
            f"latents to {report['upsampled_video']['height']}x{report['upsampled_video']['width']}"
        )
    if "largest_program" in report:  # stage 1 and --upsample: the programs a run of the stage's own code compiled
        calls = ", ".join(f"{name} x{count}" for name, count in report.get("calls", {}).items())
        print(f"  programs: {calls or ', '.join(report['programs'])}; the largest: {report['largest_program']}")
        if report.get("images"):
            print(f"  images: {report['images']}")
        for component, stand_in in report.get("stand_ins", {}).items():
            print(
                f"  {component}: {stand_in} stands in (the configs kept in code carry no tokenizer files; "
                "the prompt pads to the same length, so the programs are the published model's)"
            )
    if report["stage"] == 3:
        split = f"split along {report['split']}" if report["split"] else "NOT split: kept whole on every device"
        print(f"  latents {report['latents']} {split}; VAE tiling {'on' if report['tiling'] else 'off'}")
        if report.get("soundtrack"):
            print(
                f"  soundtrack: audio latents {report['soundtrack']['audio_latents']} decoded on the host in PyTorch, "
                "not in this plan (the TPU compiler is slow to build it: docs/ltx2.md#the-soundtrack)"
            )
        if report.get("calls"):
            calls = ", ".join(f"{name} x{count}" for name, count in report["calls"].items())
            sizes = ", ".join(f"{name} {gib(size)}" for name, size in report.get("hbm_bytes_per_program", {}).items())
            chunk = f"{report['chunk_frames']} latent frame(s) per call"
            print(f"  {chunk}: programs {calls}" + (f"; HBM per program {sizes}" if sizes else ""))
    memory = report["hbm_bytes_per_device"]
    if "arguments" in memory:
        keys = ("arguments", "temporaries", "outputs", "code", "other_experts_weights", "other_encoders_weights")
        parts = ", ".join(f"{key.replace('_', ' ')} {gib(memory[key])}" for key in keys if key in memory)
        print(f"  HBM per device: {parts}; total {gib(memory['total'])} of {gib(memory['capacity'])}")
    else:
        print(f"  HBM per device: the compiler needs {gib(memory['total'])}, has {gib(memory['compiler_limit'])}")
    spare = (
        memory["capacity"] - memory["total"] if "arguments" in memory else memory["compiler_limit"] - memory["total"]
    )
    verdict = f"fits with {gib(spare)} to spare" if report["fits"] else f"does not fit by {gib(-spare)}"
    print(f"  verdict: {verdict}" + (f"; {report['where_it_fits']}" if report.get("where_it_fits") else ""))
    if not report["fits"] and "arguments" not in memory:
        return
    collectives = report["collectives"]  # stage 2: per block and outside; stage 3: the program(s)
    for where in ("per_block", "outside_blocks") if "per_block" in collectives else tuple(collectives):
        found = collectives[where]
        text = "; ".join(
            f"{op} {v['count']} ops, {v['tensors']} tensors, {v['bytes'] / 2**20:.2f} MiB" for op, v in found.items()
        )
        label = where if "largest_program" in report else where.replace("_", " ")  # program names, or places
        print(f"  collectives {label}: {text or 'none'}")
    flops = report["flops_per_device"]
    what = report.get("work", STAGE_WORK[report["stage"]])
    print(
        f"  FLOPs per {what} per device: {flops['total']:.3e} ({flops['xla']:.3e} XLA + {flops['attention']:.3e} "
        f"attention); at peak bf16 that is at least {report[what + '_seconds_lower_bound']:.3f} s (a lower bound)"
    )
    if what + "_seconds_lower_bound_int8" in report:
        print(f"  with XLA's FLOPs at peak int8: at least {report[what + '_seconds_lower_bound_int8']:.3f} s")
    if "quantize" in report:
        found = report["quantize"]
        print(
            f"  quantized {found['scheme']} ({found['layers']}): {found['matmuls']} matmuls read the quantized "
            f"weights; {found['dequantized']} dequantized copies of them are stored"
        )
    if report.get("videos", 1) > 1:
        print(
            f"  a batch of {report['videos']} videos: at least "
            f"{report['step_seconds_lower_bound_per_video']:.3f} s per video per step"
        )
    for shape in report.get("splash_padding", ()):
        print(
            f"  Splash x{shape['calls']}: q {shape['q_len']} -> {shape['q_padded']} "
            f"({shape['q_padding_percent']}% padding), kv {shape['kv_len']} -> {shape['kv_padded']} "
            f"({shape['kv_padding_percent']}%)"
        )
    cached = report.get("step_cache")
    if cached:
        memory = cached["hbm_bytes_per_device"]
        if cached["fits"]:
            print(
                f"  cached step ({cached['kind']}): HBM per device {gib(memory['total'])}; FLOPs per device "
                f"{cached['flops_per_device']['total']:.3e}, at least {cached['step_seconds_lower_bound']:.3g} s"
            )
        else:
            print(f"  cached step ({cached['kind']}): does not fit, needs {gib(memory['total'])}")
    between = report.get("between_loops")
    if between and "hbm_bytes_per_program" in between:
        sizes = ", ".join(
            f"{name} x{between['calls'][name]} {gib(size)}" for name, size in between["hbm_bytes_per_program"].items()
        )
        verdict = "fits" if between["fits"] else "does NOT fit"
        print(
            f"  between segments (the VAE's decode and encode in fp32), HBM per device with the step's arguments: "
            f"{sizes}; later segments' steps with the VAE's weights {gib(between['later_steps_hbm_bytes_per_device'])}"
            f"; {verdict}; at least {between['seconds_lower_bound']:.3g} s per segment at peak bf16"
        )
    elif between:
        needs = gib(between["hbm_bytes_per_device"])
        print(f"  between segments (the VAE's decode and encode): does NOT fit, needs {needs}")
