"""Stage 2's flags (stage2_transformer.py --help): the input and output folders, batches, attention and its
Splash options, the mesh, the step cache, the block scan, quantization, LoRA, checkpoints, the runtime and
multi-host settings, planning, and the request overrides; and where a profiler trace goes (`profile_dir`)."""

from __future__ import annotations

import argparse

from tpu_video.attention.sp_modes import SP_MODES
from tpu_video.cli import (
    UserError,
    add_executables_argument,
    add_plan_arguments,
    dtype_flag,
    finite_float,
    flag_names,
    stage_parser,
)
from tpu_video.stages.feature_flags import (
    add_cache_flags,
    add_lora_flags,
    add_multihost_flags,
    add_quantize_flags,
    add_scan_flag,
)
from tpu_video.stages.request import add_request_arguments, note_stage1_flags
from utils import CHECKPOINT_FILE, DEFAULT_OUTPUT_DIR

PROFILE_DIR = "./jax-trace"  # the reference scripts' default trace folder


def build_parser(script: str, description: str | None):
    """The stage's argparse parser (`script` and `description`: the stage script's file and docstring)."""
    parser = stage_parser(script, description)
    parser.add_argument(
        "--input_dir",
        nargs="+",
        help=f"folder(s) with stage 1's files, or a batch folder (its batch.json) (default: {DEFAULT_OUTPUT_DIR}; "
        "with --plan and --model: none, the plan is made from the model and the request flags)",
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        help="several folders: videos per batch, those of a group sharing one compiled program (default: the "
        "largest part of the group whose default mesh gives each device one sample (a video's CFG branch) with "
        "the weights within their share of memory; 1 with --cache magcache)",
    )
    parser.add_argument("--output_dir", help="where to write the latents and config (default: --input_dir)")
    parser.add_argument(
        "--start_latents",
        metavar="FOLDER",
        help="a later pass: start from FOLDER's stage-2 latents where the denoise would draw its initial noise, as "
        "the pipeline called with latents= (same model family, size and frame count; write it to its own "
        "--output_dir; Wan, HunyuanVideo-1.5, CogVideoX 1.0, LTX-2; docs/usage.md#a-second-pass)",
    )
    between = parser.add_argument_group(
        "between two passes (LTX-2's two-stage pipeline; docs/ltx2.md#the-two-stage-pipeline)"
    )
    between.add_argument(
        "--upsample",
        action="store_true",
        help="instead of a denoise: run the model's x2 latent upsampler on --input_dir's stage-2 latents and write "
        "them, at twice the height and width, to --output_dir (the next pass's --start_latents)",
    )
    between.add_argument(
        "--latent_upsampler",
        metavar="PATH",
        help="with --upsample: a folder holding the upsampler's config.json, or a model folder or hub id holding a "
        "latent_upsampler subfolder (default: the model's own)",
    )
    between.add_argument(
        "--adain_factor",
        type=finite_float,
        default=0.0,
        help="with --upsample: AdaIN toward the input's per-channel statistics, -10 to 10 (default: %(default)s: off)",
    )
    between.add_argument(
        "--tone_map_compression_ratio",
        type=finite_float,
        default=0.0,
        help="with --upsample: compress the latents' dynamic range, 0 (off) to 1 (default: %(default)s)",
    )
    parser.add_argument(
        *flag_names("--model"), dest="model", help="override the model recorded by stage 1 (same family only)"
    )
    parser.add_argument(
        "--dtype", type=dtype_flag, help="bf16, fp16 or fp32 (or float32, ...) for the transformer (default: stage 1's)"
    )
    attention = parser.add_argument_group("attention")
    attention.add_argument(
        "--attention",
        choices=("auto", "splash", "xla", "cudnn"),
        default="auto",
        help="splash: the Pallas Splash kernel (Pallas interpret mode off TPU); cudnn: JAX's cuDNN fused "
        "attention (NVIDIA GPU, bf16/fp16); xla: plain XLA softmax attention (tpu_video/attention/xla.py); "
        "auto: Splash on TPU, cuDNN on a GPU (XLA in fp32), else xla (default: auto)",
    )
    for name in ("block_q", "block_kv", "block_kv_compute"):
        attention.add_argument(f"--{name}", type=int, help="Splash tile size, a multiple of 128 (default: per family)")
    attention.add_argument(
        "--local_window", type=int, help="Splash: each token attends to tokens within this distance (default: off)"
    )
    attention.add_argument(
        "--k_smoothing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Splash: subtract the mean of the valid keys (exact; centres scores for bf16) (default: off)",
    )
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument(
        "--warmup_steps",
        type=int,
        default=2,
        help="denoiser calls before the timed loop, to build its programs; results discarded (default: %(default)s)",
    )
    runtime.add_argument(
        "--no_compile_cache",
        action="store_true",
        help="do not use the persistent JAX compilation cache (folder: $JAX_COMPILATION_CACHE_DIR, "
        "else ~/.cache/tpu-video/jax-compilation-cache)",
    )
    add_executables_argument(runtime)
    add_scan_flag(runtime)
    runtime.add_argument(
        "--checkpoint_every",
        type=int,
        default=0,
        metavar="N",
        help=f"save the loop state to {CHECKPOINT_FILE} every N steps (SIGTERM always saves one) (default: off)",
    )
    runtime.add_argument(
        "--resume", action="store_true", help=f"continue from {CHECKPOINT_FILE} in --output_dir (same request)"
    )
    runtime.add_argument("--profile", metavar="DIR", help="write a JAX profiler trace of the first 3 timed steps")
    runtime.add_argument(
        "--enable_profiler",
        action="store_true",
        help=f"the reference scripts' spelling of --profile: trace into --profiler_output_dir (default: {PROFILE_DIR})",
    )
    runtime.add_argument("--profiler_output_dir", metavar="DIR", help="with --enable_profiler: where the trace goes")
    add_cache_flags(parser)
    add_lora_flags(parser)
    add_quantize_flags(parser)
    mesh = parser.add_argument_group(
        "device mesh (product must equal the device count; unset axes are chosen and logged, docs/sharding.md)"
    )
    mesh.add_argument(
        "--dp",
        type=int,
        help="data parallel: the CFG branches (default: 2 with CFG where the weights still fit, else 1)",
    )
    mesh.add_argument(
        "--sp", type=int, help="sequence parallel: the video tokens split between blocks (default: the rest)"
    )
    mesh.add_argument(
        "--sp_mode",
        choices=SP_MODES,
        default="auto",
        help="attention over the split sequence. ulysses: all-to-alls trade the sequence split for a head "
        "split (needs the heads per tp shard to divide by sp); ring: key/value chunks pass round the sp devices "
        "(any head count, no --local_window); gather: queries stay split and every device gathers all keys "
        "and values; auto: ulysses where the heads allow, else ring (gather with --local_window) "
        "(default: %(default)s)",
    )
    mesh.add_argument(
        "--tp", type=int, help="tensor parallel: heads and MLP columns (default: the most the heads allow in one host)"
    )
    mesh.add_argument(
        "--tp_mode",
        choices=("megatron", "replicated_out"),
        default="megatron",
        help="megatron: attention-out and MLP-out row-parallel; replicated_out: those stay replicated "
        "(more memory; see docs/sharding.md) (default: %(default)s)",
    )
    add_multihost_flags(parser)
    compiles = "this run's denoiser (its collectives, FLOPs and Splash padding reported too)"
    add_plan_arguments(parser, compiles, ". Without stage-1 files, plans from --model and the request flags")
    add_request_arguments(parser, for_later_stage=True)
    note_stage1_flags(parser)
    return parser


def profile_dir(args) -> str | None:
    """Where the profiler trace goes: `--profile DIR`, or the reference scripts' `--enable_profiler` with
    `--profiler_output_dir`; None for no trace."""
    if args.profiler_output_dir and not args.enable_profiler:
        raise UserError("--profiler_output_dir needs --enable_profiler (or use --profile DIR)")
    if not args.enable_profiler:
        return args.profile
    if args.profile and args.profiler_output_dir and args.profile != args.profiler_output_dir:
        raise UserError("--profile and --profiler_output_dir name different folders; give one")
    return args.profile or args.profiler_output_dir or PROFILE_DIR
