"""Stage 3's flags (stage3_vae_decoder.py --help): the input folders and where the video goes, the backend and
device, the frame programs and tiling, the preview and saved frames, and planning."""

from __future__ import annotations

import argparse

from tpu_video.cli import add_executables_argument, add_plan_arguments, dtype_flag, flag_names, stage_parser
from tpu_video.runtime.backend import STAGE3_BACKENDS
from tpu_video.stages.request import note_stage1_flags
from utils import DEFAULT_OUTPUT_DIR, VIDEO_FILE

PLAN_REQUEST_KEYS = ("height", "width", "num_frames")  # with --plan: the video to plan for


def build_parser(script: str, description: str | None):
    """The stage's argparse parser (`script` and `description`: the stage script's file and docstring)."""
    parser = stage_parser(script, description)
    parser.add_argument(
        "--input_dir",
        nargs="+",
        help=f"folder(s) with stage 2's files, or a batch folder (its batch.json) (default: {DEFAULT_OUTPUT_DIR}; "
        "with --plan and --model: none, the plan is made from the model and the request flags)",
    )
    parser.add_argument("--output_dir", help="where to write the video and config (default: --input_dir)")
    parser.add_argument("--output_name", default=VIDEO_FILE, help="video file name (default: %(default)s)")
    parser.add_argument(
        "--output_video",
        metavar="PATH",
        help="the reference scripts' spelling: the mp4 at PATH (its folder and name), preview and frames beside it",
    )
    parser.add_argument(
        *flag_names("--model"), dest="model", help="override the model recorded by stage 1 (same family only)"
    )
    parser.add_argument(
        "--backend",
        choices=STAGE3_BACKENDS,
        default="auto",
        help="auto: torch on CUDA if torch sees a GPU, else torchax if JAX sees a TPU or GPU, else torch on "
        "the CPU (default: %(default)s)",
    )
    parser.add_argument("--device", help="torch device for --backend torch (default: cpu)")
    parser.add_argument(
        "--dtype", type=dtype_flag, help="bf16, fp16 or fp32 (or float32, ...) for the VAE (default: the request's)"
    )
    parser.add_argument("--dp", type=int, help=argparse.SUPPRESS)  # the reference's Flax decoder flag: refused
    parser.add_argument(
        "--save_frames",
        action="store_true",
        help="also write <video name>_frames.safetensors: `frames` uint8 (F, H, W, 3) as encoded and "
        "`frames_float` float32 in [0, 1] before quantisation; with a soundtrack (LTX-2) also `waveform`, float32 "
        "(channels, samples) before AAC (default: off)",
    )
    parser.add_argument("--fps", type=int, help="override the request's frames per second")
    parser.add_argument(
        "--tiling",
        action="store_true",
        help="--backend torch: decode in spatial tiles (diffusers' VAE tiling) to save memory",
    )
    parser.add_argument(
        "--chunk_frames",
        type=int,
        help="--backend torchax: latent frames per compiled call, the VAE's state carried between calls; 0 "
        "compiles the whole decode as one program (Wan 1, CogVideoX 2, HunyuanVideo-1.5 1 to 32; default: "
        "the first)",
    )
    parser.add_argument(
        "--preview_frames",
        type=int,
        default=8,
        help="frames in the preview PNG grid, 0 for none (default: %(default)s)",
    )
    parser.add_argument(
        "--no_compile_cache", action="store_true", help="torchax: do not use the persistent JAX compilation cache"
    )
    add_executables_argument(parser)
    compiles = (
        "this decode (--backend torchax layout: VAE replicated, latents split over every device along width, else "
        "height, else width unevenly; each frame program, with the calls per video)"
    )
    planning = add_plan_arguments(parser, compiles)
    for name in PLAN_REQUEST_KEYS:
        planning.add_argument(f"--{name}", type=int, help="with --plan: the video to plan for (default: the request's)")
    note_stage1_flags(parser)
    return parser
