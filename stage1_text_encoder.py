#!/usr/bin/env python
"""Stage 1: encode the prompt and negative prompt with the pipeline's own text encoder(s).

Writes stage1_embeddings.safetensors and starts a new generation_config.json holding the request.
Runs in plain PyTorch (CPU by default) and never imports JAX.
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
    parser.add_argument("--device", default="cpu", help="torch device for the text encoder (default: %(default)s)")
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
    dtype = parse_dtype(args.dtype)
    output_dir = Path(args.output_dir)
    timer = Timer()

    source, family = models.resolve_model(args.model)
    request = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "dtype": args.dtype}
    request.update(family.request_defaults(source), seed=DEFAULT_SEED)
    request.update({key: value for key, value in request_flags(args).items() if value is not None})
    family.validate_request(source, request)
    ensure_writable_dir(output_dir)
    log(f"{family.NAME} from {args.model}: encoding prompt on {args.device} in {args.dtype}")

    with timer.phase("encode"):
        embeddings = family.encode_prompts(source, request, dtype, args.device)
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
            "device": args.device,
            "dtype": args.dtype,
            "seconds": timer.finish(),
            "versions": library_versions("torch", "transformers", "diffusers"),
        },
    }
    write_config(output_dir, config)
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in embeddings.items())
    log(f"wrote {output_dir / STAGE1_FILE}: {shapes}")


if __name__ == "__main__":
    run_cli(main)
