#!/usr/bin/env python
"""Stage 2: denoise with the stock diffusers transformer running on a JAX device through torchax.

Reads stage1_embeddings.safetensors + generation_config.json, shards the transformer over a dp/sp/tp
mesh, runs the family's scheduler loop with classifier-free guidance (latents checked for NaN/Inf after
every step; checkpoints with --checkpoint_every and on SIGTERM, continued with --resume), and writes
stage2_latents.safetensors (tensor `latents`, layout B,C,F,H,W, normalised as the transformer sees them:
the section's `latents_normalization` says how; LTX-2 adds `audio_latents`) plus a `stage2` section in the config.
"""

from __future__ import annotations

import argparse

from tpu_video.cli import log, run_cli
from tpu_video.stages import stage2_flags
from tpu_video.workarounds.warning_filters import filter_harmless_warnings


def parse_args(argv=None) -> argparse.Namespace:
    return stage2_flags.build_parser(__file__, __doc__).parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.process_id:  # the libraries load once the flags are read (--help needs none); process 0 logs
        log("stage 2: loading torch, JAX and diffusers")
    filter_harmless_warnings()
    from tpu_video.stages.stage2_run import run

    run(args)


def cli() -> None:
    """The installed command (pyproject.toml's scripts): main() under the CLI conventions, as below."""
    run_cli(main)


if __name__ == "__main__":
    cli()
