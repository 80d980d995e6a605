#!/usr/bin/env python
"""Stage 2: denoise with the stock diffusers transformer running on a JAX device through torchax.

Reads stage1_embeddings.safetensors + generation_config.json, shards the transformer over a dp/sp/tp
mesh, runs the family's scheduler loop with classifier-free guidance (latents checked for NaN/Inf after
every step; checkpoints with --checkpoint_every and on SIGTERM, continued with --resume), and writes
stage2_latents.safetensors (tensor `latents`, layout B,C,F,H,W, still multiplied by the VAE scaling
factor) plus a `stage2` section in the config.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import models
from utils import (
    CHECKPOINT_FILE,
    DEFAULT_OUTPUT_DIR,
    REQUEST_KEYS,
    STAGE2_FILE,
    CompileCache,
    DenoiseGuard,
    Timer,
    UserError,
    add_request_arguments,
    apply_request_overrides,
    ensure_writable_dir,
    filter_harmless_warnings,
    library_versions,
    log,
    parse_dtype,
    read_config,
    read_tensors,
    request_flags,
    run_cli,
    write_config,
    write_tensors,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--input_dir", default=DEFAULT_OUTPUT_DIR, help="folder with stage 1's files (default: %(default)s)"
    )
    parser.add_argument("--output_dir", help="where to write the latents and config (default: --input_dir)")
    parser.add_argument("--model", help="override the model recorded by stage 1 (same family only)")
    parser.add_argument("--dtype", help="bf16, fp16 or fp32 for the transformer (default: stage 1's dtype)")
    attention = parser.add_argument_group("attention")
    attention.add_argument(
        "--attention",
        choices=("auto", "splash", "xla"),
        default="auto",
        help="Splash kernel (interpret mode off TPU) or torchax's XLA lowering; auto: Splash on TPU (default: auto)",
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
        help="denoiser calls before the timed loop, to compile; results discarded (default: %(default)s)",
    )
    runtime.add_argument(
        "--no_compile_cache",
        action="store_true",
        help="do not use the persistent JAX compilation cache (folder: $JAX_COMPILATION_CACHE_DIR, "
        "else ~/.cache/tpu-video/jax-compilation-cache)",
    )
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
    mesh = parser.add_argument_group("device mesh (product must equal the device count)")
    mesh.add_argument("--dp", type=int, help="data parallel: the CFG branches (default: 2 with CFG if it fits, else 1)")
    mesh.add_argument("--sp", type=int, help="sequence parallel: query tokens in attention (default: 1)")
    mesh.add_argument("--tp", type=int, help="tensor parallel: heads and MLP columns (default: the remaining devices)")
    mesh.add_argument(
        "--tp_mode",
        choices=("megatron", "replicated_out"),
        default="megatron",
        help="megatron: attention-out and MLP-out row-parallel; replicated_out: those stay replicated "
        "(more memory; see README) (default: %(default)s)",
    )
    add_request_arguments(parser, for_later_stage=True)
    return parser.parse_args(argv)


def splash_config(args, family, platform: str):
    from splash_attention import SplashConfig

    blocks = dict(family.SPLASH_BLOCK_SIZES)
    blocks.update({name: getattr(args, name) for name in blocks if getattr(args, name) is not None})
    try:
        return SplashConfig(
            **blocks, interpret=platform != "tpu", local_window=args.local_window, k_smoothing=args.k_smoothing
        )
    except ValueError as err:
        raise UserError(f"--{err}") from None


def main(argv=None) -> None:
    args = parse_args(argv)
    filter_harmless_warnings()
    if args.warmup_steps < 0:
        raise UserError(f"--warmup_steps {args.warmup_steps} must be >= 0")
    input_dir = Path(args.input_dir)
    output_dir = Path(args.output_dir or args.input_dir)
    timer = Timer()

    config = read_config(input_dir, needs="stage1")
    source, family = models.resolve_model_for_config(config, args.model)
    overrides = apply_request_overrides(config, request_flags(args))
    if args.model:
        overrides.update(apply_request_overrides(config, {"model_id": args.model}))
    dtype_name = args.dtype or config["dtype"]
    dtype = parse_dtype(dtype_name)
    family.validate_request(source, config)
    embeddings = read_tensors(input_dir, config["stage1"])
    ensure_writable_dir(output_dir)
    fingerprint = {key: config.get(key) for key in ("model_id", *REQUEST_KEYS)}
    guard = DenoiseGuard(
        output_dir,
        {**fingerprint, "dtype": dtype_name, "stage1_sha256": config["stage1"]["sha256"]},
        every=args.checkpoint_every,
        resume=args.resume,
    )

    # JAX is imported only once the inputs are known good.
    import jax

    import sharding
    from splash_attention import attention_backend, resolve_backend
    from torchax_runtime import TorchaxRuntime

    compile_cache = CompileCache(enabled=not args.no_compile_cache)
    mesh_shape = sharding.choose_mesh_shape(
        jax.device_count(),
        args.dp,
        args.sp,
        args.tp,
        cfg=family.cfg_enabled(config["guidance_scale"]),
        heads=family.attention_heads(source),
    )
    runtime = TorchaxRuntime(sharding.make_mesh(mesh_shape), profile_dir=args.profile)
    attention = resolve_backend(args.attention)
    splash = splash_config(args, family, runtime.device_description["platform"])
    log(f"{family.NAME} transformer on {runtime.device_description}, {dtype_name}, attention {attention}")
    log(f"request overrides: {overrides or 'none'}")
    with attention_backend(runtime.env, attention, splash, runtime.mesh), guard.install_stop_handler():
        latents, info = family.denoise(
            source,
            config,
            embeddings,
            dtype,
            runtime,
            timer,
            tp_mode=args.tp_mode,
            warmup_steps=args.warmup_steps,
            guard=guard,
        )
    with timer.phase("save"):
        record = write_tensors(output_dir / STAGE2_FILE, {"latents": latents})

    config["stage2"] = {
        **record,
        "stage1_sha256": config["stage1"]["sha256"],
        "request": fingerprint,
        "resumed": args.resume,
        **info,
        "backend": runtime.name,
        **runtime.device_description,
        "dtype": dtype_name,
        "tp_mode": args.tp_mode,
        "placement": runtime.placement,
        "attention": attention,
        **({"splash": dataclasses.asdict(splash)} if attention == "splash" else {}),
        "overrides": overrides,
        "warmup_steps": args.warmup_steps,
        "compile_cache": compile_cache.report(),
        "seconds": timer.finish(),
        "step_seconds": timer.step_seconds,
        "versions": library_versions("torch", "jax", "jaxlib", "torchax", "diffusers"),
    }
    write_config(output_dir, config)
    guard.finished()
    log(f"wrote {output_dir / STAGE2_FILE}: latents {tuple(latents.shape)} ({info['latents_layout']})")


if __name__ == "__main__":
    run_cli(main)
