#!/usr/bin/env python
"""Stage 3: decode stage 2's latents with the pipeline's VAE and write an mp4.

`--backend auto` (default) decodes where the accelerator is: torch on CUDA, else torchax on a TPU or GPU
that JAX sees, else torch on the CPU. `--backend torch` runs plain PyTorch on CPU or CUDA and never
imports JAX (for GPU hosts); `--backend torchax` runs the same VAE on every JAX device. The latents'
normalisation that stage 2 recorded (the VAE scaling factor, or Wan's per-channel mean and std) is
undone exactly as the diffusers pipeline does before decoding.

Several input folders (or a batch folder stage 1 wrote, standing for the folders its batch.json lists) are
decoded one after another with one loaded VAE, each video written into its own folder.
"""

from __future__ import annotations

import argparse

from tpu_video.cli import log, run_cli
from tpu_video.stages import stage3_flags
from tpu_video.workarounds.warning_filters import filter_harmless_warnings


def parse_args(argv=None) -> argparse.Namespace:
    return stage3_flags.build_parser(__file__, __doc__).parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    log("stage 3: loading torch and diffusers")  # the libraries load once the flags are read: --help needs none
    filter_harmless_warnings()
    from tpu_video.stages.stage3_run import run

    run(args)


def cli() -> None:
    """The installed command (pyproject.toml's scripts): main() under the CLI conventions, as below."""
    run_cli(main)


if __name__ == "__main__":
    cli()
