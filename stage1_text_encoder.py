#!/usr/bin/env python
"""Stage 1: encode the prompt and negative prompt with the pipeline's own text encoder(s).

Writes stage1_embeddings.safetensors and starts a new generation_config.json holding the request.
`--backend torch` (default) runs plain PyTorch on CPU or CUDA and never imports JAX; `--backend torchax`
runs the same encoders jitted on all JAX devices, their weights split over a `tp` mesh axis by the
encoder's rule table (sharding.py: T5, Qwen2.5-VL).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import models
from utils import (
    DEFAULT_OUTPUT_DIR,
    FORMAT_VERSION,
    STAGE1_FILE,
    Timer,
    TorchRuntime,
    UserError,
    add_request_arguments,
    ensure_writable_dir,
    filter_harmless_warnings,
    library_versions,
    log,
    parse_dtype,
    read_config,
    request_flags,
    run_cli,
    torch_device,
    torchax_runtime_on_all_devices,
    write_config,
    write_tensors,
)

DEFAULT_MODEL = "zai-org/CogVideoX1.5-5B"
DEFAULT_SEED = 42


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id, local diffusers folder, or preset ({', '.join(models.PRESETS)}); default: %(default)s",
    )
    parser.add_argument("--prompt", required=True, help="what the video should show")
    parser.add_argument("--negative_prompt", default="", help="what to steer away from (default: empty)")
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR, help="stage folder (default: %(default)s)")
    parser.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (default: %(default)s)")
    parser.add_argument("--backend", choices=("torch", "torchax"), default="torch", help="default: %(default)s")
    parser.add_argument("--device", help="torch device for --backend torch (default: cpu)")
    parser.add_argument(
        "--no_compile_cache", action="store_true", help="torchax: do not use the persistent JAX compilation cache"
    )
    add_request_arguments(parser, for_later_stage=False)
    return parser.parse_args(argv)


def earlier_sections(output_dir: Path) -> dict:
    """Stage 2/3 sections of an existing config in the folder, kept (a stage never deletes another's
    section); their recorded input checksums tell later stages whether they are stale."""
    try:
        previous = read_config(output_dir)
    except UserError:
        return {}
    return {key: value for key, value in previous.items() if key in ("stage2", "stage3")}


def main(argv=None) -> None:
    args = parse_args(argv)
    filter_harmless_warnings()
    device = torch_device(args.backend, args.device)
    dtype = parse_dtype(args.dtype)
    output_dir = Path(args.output_dir)
    timer = Timer()

    source, family = models.resolve_model(args.model)
    request = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "dtype": args.dtype}
    request.update(family.request_defaults(source), seed=DEFAULT_SEED)
    request.update({key: value for key, value in request_flags(args).items() if value is not None})
    family.validate_request(source, request)
    ensure_writable_dir(output_dir)

    compile_cache = None
    if args.backend == "torch":
        runtime = TorchRuntime(device)
        where = device
    else:  # one prompt at a time: every device goes to `tp` (heads and MLP columns)
        runtime, compile_cache = torchax_runtime_on_all_devices("tp", compile_cache=not args.no_compile_cache)
        description = runtime.device_description
        where = f"{description['device_count']} {description['platform']} device(s)"
    log(f"{family.NAME} from {args.model}: encoding prompt on {where} ({args.backend}) in {args.dtype}")

    with timer.phase("encode"):
        embeddings = family.encode_prompts(source, request, dtype, runtime)
    with timer.phase("save"):
        record = write_tensors(output_dir / STAGE1_FILE, embeddings)

    config = {
        **earlier_sections(output_dir),
        "format_version": FORMAT_VERSION,
        "model_family": family.NAME,
        "model_id": args.model,
        **request,
        "stage1": {
            **record,
            "backend": args.backend,
            **(
                {"device": device}
                if args.backend == "torch"
                else {**runtime.device_description, "placement": runtime.placements}
            ),
            **({"compile_cache": compile_cache.report()} if compile_cache else {}),
            "dtype": args.dtype,
            "seconds": timer.finish(),
            "versions": library_versions(
                "torch", "transformers", "diffusers", *(("jax", "torchax") if args.backend == "torchax" else ())
            ),
        },
    }
    write_config(output_dir, config)
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in embeddings.items())
    log(f"wrote {output_dir / STAGE1_FILE}: {shapes}")


if __name__ == "__main__":
    run_cli(main)
