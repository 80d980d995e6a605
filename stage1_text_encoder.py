#!/usr/bin/env python
"""Stage 1: encode the prompt and negative prompt with the pipeline's own text encoder(s), and the media
inputs the model takes (image-to-video: `--image`, `--last_image`; Wan video-to-video: `--video`; Wan VACE:
`--control_video`, `--mask`, `--reference_images`; Wan Animate: `--image`, `--pose_video`, `--face_video`,
`--background_video`, `--mask_video`; LTX-2's keyframes and clips: `--condition`, placed by the ltx2 options
`--condition_index` and `--condition_strength`) with its image encoder and VAE.

Writes stage1_embeddings.safetensors and starts a new generation_config.json holding the request. With
`--prompts FILE` (or `--seeds` for one prompt) it writes one such folder per entry under --output_dir, and
a batch.json listing them, loading the encoders once.
`--backend torch` (default) runs plain PyTorch on CPU or CUDA and never imports JAX; `--backend torchax`
runs the same text encoders jitted on all JAX devices, their weights split over a `tp` mesh axis by the
encoder's rule table (sharding.py: T5, Qwen2.5-VL, Gemma 3 and 4). The image and video conditioning runs on the host
in fp32.
"""

from __future__ import annotations

import argparse

from tpu_video.cli import log, run_cli
from tpu_video.stages import stage1_flags
from tpu_video.workarounds.warning_filters import filter_harmless_warnings


def parse_args(argv=None) -> argparse.Namespace:
    return stage1_flags.build_parser(__file__, __doc__).parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    log("stage 1: loading torch and diffusers")  # the libraries load once the flags are read: --help needs none
    filter_harmless_warnings()
    from tpu_video.stages.stage1_run import run

    run(args)


def cli() -> None:
    """The installed command (pyproject.toml's scripts): main() under the CLI conventions, as below."""
    run_cli(main)


if __name__ == "__main__":
    cli()
