"""The engine features' flags and their reading into the frozen settings the engine takes: stage 2's step
cache (engine.cache_schedule.CacheSettings), LoRA adapters (the `(flag, text)` pairs engine.lora reads),
quantization (engine.settings.Quantization), the block scan and the multi-host launch (stage 1's `--lora` is
in stage1_flags). The engine reads no argparse namespace: what a setting means is the engine's, how it is
spelled and checked as a flag is here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpu_video.cli import UserError, finite_float, log
from tpu_video.engine.cache_schedule import KINDS, CacheSettings
from tpu_video.engine.mag_ratios import MAG_RATIOS_FILE, read_mag_ratios
from tpu_video.engine.settings import LAYER_SETS, LORA_FLAGS, SCAN_CHOICES, SCHEMES, Quantization
from tpu_video.runtime.distributed import DEFAULT_PEER_TIMEOUT

CACHE_DEFAULTS = CacheSettings()  # the cache flags' defaults, stated once (diffusers' for MagCache)
MAGCACHE_FLAGS = {
    "threshold": "cache_threshold",
    "max_skip_steps": "cache_max_skip_steps",
    "retention_ratio": "cache_retention_ratio",
}
INTERVAL_FLAGS = {
    "start_step": "cache_start_step",
    "end_step": "cache_end_step",
    "step_interval": "cache_step_interval",
}
# Values outside these change nothing or mean nothing (a negative threshold skips no step).
MAGCACHE_RANGES = {
    "cache_threshold": (lambda value: value > 0, "greater than 0"),
    "cache_max_skip_steps": (lambda value: value >= 1, "at least 1"),
    "cache_retention_ratio": (lambda value: 0 <= value < 1, "from 0 up to (not including) 1"),
}


def add_cache_flags(parser) -> None:
    """Stage 2's step-cache flags (read back by cache_settings)."""
    cache = parser.add_argument_group(
        "step cache (reuse the transformer blocks' residual on some steps; see docs/caching.md)"
    )
    cache.add_argument(
        "--cache",
        choices=KINDS,
        default="none",
        help="magcache: diffusers' MagCache, steps skipped while the magnitude ratios' accumulated error stays "
        "small; interval: every step runs the first and last block, the deep blocks run on a fixed interval "
        "(default: %(default)s)",
    )
    cache.add_argument(
        "--enable_cache", action="store_true", help="the reference scripts' spelling of --cache interval"
    )
    cache.add_argument(
        "--cache_threshold",
        type=finite_float,
        help=f"magcache: accumulated-error threshold (default: {CACHE_DEFAULTS.threshold})",
    )
    cache.add_argument(
        "--cache_max_skip_steps",
        type=int,
        help=f"magcache: most consecutive skipped steps (default: {CACHE_DEFAULTS.max_skip_steps})",
    )
    cache.add_argument(
        "--cache_retention_ratio",
        type=finite_float,
        help=f"magcache: the first fraction of steps is never skipped (default: {CACHE_DEFAULTS.retention_ratio})",
    )
    cache.add_argument(
        "--cache_mag_ratios",
        metavar="FILE",
        help=f"magcache: magnitude ratios, a JSON list of numbers or the {MAG_RATIOS_FILE} --cache_calibrate "
        f"writes (default: {MAG_RATIOS_FILE} in --input_dir, if there)",
    )
    cache.add_argument(
        "--cache_calibrate",
        action="store_true",
        help=f"run every step in full and write the model's magnitude ratios to {MAG_RATIOS_FILE} in --output_dir",
    )
    cache.add_argument(
        "--cache_start_step",
        type=int,
        help=f"interval: first step that may reuse (0-based) (default: {CACHE_DEFAULTS.start_step})",
    )
    cache.add_argument(
        "--cache_end_step",
        type=int,
        help=f"interval: steps from here on all compute (default: {CACHE_DEFAULTS.end_step})",
    )
    cache.add_argument(
        "--cache_step_interval",
        type=int,
        help=f"interval: within the window, compute every Nth step (default: {CACHE_DEFAULTS.step_interval})",
    )


def cache_kind(args) -> str:
    """none, magcache or interval, as the flags ask (--enable_cache: interval; --cache_calibrate: magcache);
    a flag of the other kind, or one without --cache, is an error. A run and --plan both check here."""
    kind = args.cache
    if args.enable_cache:
        if kind not in ("none", "interval"):
            raise UserError(f"--enable_cache means --cache interval; it cannot go with --cache {kind}")
        kind = "interval"
    if args.cache_calibrate and kind == "interval":
        raise UserError("--cache_calibrate calibrates MagCache; it cannot go with --cache interval")
    magcache = kind == "magcache" or args.cache_calibrate
    for flags, active, what in (
        ([*MAGCACHE_FLAGS.values(), "cache_mag_ratios"], magcache, "--cache magcache"),
        (INTERVAL_FLAGS.values(), kind == "interval", "--cache interval (or --enable_cache)"),
    ):
        given = [f"--{flag}" for flag in flags if getattr(args, flag) is not None]
        if given and not active:
            verb = "applies" if len(given) == 1 else "apply"
            raise UserError(f"{', '.join(given)} only {verb} with {what}")
    for flag, (meaningful, rule) in MAGCACHE_RANGES.items():
        value = getattr(args, flag)
        if value is not None and not meaningful(value):
            raise UserError(f"--{flag} {value} must be {rule}")
    return "magcache" if magcache else kind


def cache_settings(args) -> CacheSettings:
    """The step cache the flags ask for, checked (cache_kind), without MagCache's ratios (with_mag_ratios)."""
    kind = cache_kind(args)
    values = {
        key: getattr(args, flag)
        for key, flag in {**MAGCACHE_FLAGS, **INTERVAL_FLAGS}.items()
        if getattr(args, flag) is not None
    }
    return CacheSettings(kind=kind, calibrate=args.cache_calibrate, **values)


def with_mag_ratios(
    settings: CacheSettings, args, input_dir: Path, model_id: str, adapters=None, quantize=None
) -> CacheSettings:
    """`settings` with MagCache's ratios read (calibrated for this model, these LoRA adapters and this
    quantization): --cache_mag_ratios, else the file in the input folder."""
    if settings.kind != "magcache" or settings.calibrate:
        return settings
    path = Path(args.cache_mag_ratios) if args.cache_mag_ratios else input_dir / MAG_RATIOS_FILE
    if not args.cache_mag_ratios and not path.is_file():
        raise UserError(
            f"--cache magcache needs the model's magnitude ratios: --cache_mag_ratios FILE, or a "
            f"{MAG_RATIOS_FILE} in {input_dir} (write one with --cache_calibrate)"
        )
    ratios = read_mag_ratios(path, model_id, adapters, quantize)
    log(f"MagCache ratios from {path}")
    return dataclasses.replace(settings, mag_ratios=ratios)


LORA_VALUE = "PATH[:SCALE]"


def add_lora_flags(parser) -> None:
    """Stage 2's `--lora` and `--lora_2` (read back by lora_flags)."""
    group = parser.add_argument_group("LoRA adapters (fused into the weights before placement; docs/lora.md)")
    group.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar=LORA_VALUE,
        help="a LoRA adapter for the transformer (Wan 2.2: the high-noise expert): a .safetensors file, a folder "
        "holding one, or a hub id org/name[/file.safetensors]; SCALE any finite number (default 1.0); repeatable",
    )
    group.add_argument(
        "--lora_2",
        action="append",
        default=[],
        metavar=LORA_VALUE,
        help="Wan 2.2 A14B: a LoRA adapter for transformer_2, the low-noise expert; repeatable",
    )


def lora_flags(args) -> list[tuple[str, str]]:
    """Every adapter flag given, as `(flag, PATH[:SCALE])` in flag order (what engine.lora.read_adapters reads)."""
    return [(flag, text) for flag in LORA_FLAGS for text in getattr(args, flag.lstrip("-"))]


def add_quantize_flags(parser) -> None:
    """`--quantize` and `--quantize_layers` (read back by quantization)."""
    group = parser.add_argument_group("quantized weights (docs/quantization.md)")
    group.add_argument(
        "--quantize",
        choices=SCHEMES,
        default="none",
        help="the transformer blocks' linear weights in int8 (int8_weight: weights only; int8: and each token's "
        "activations, int8 x int8 matmuls) or fp8 e4m3 (fp8_weight), one scale per output channel, as torchao "
        "0.18 quantizes them (default: %(default)s)",
    )
    group.add_argument(
        "--quantize_layers",
        choices=LAYER_SETS,
        help="which linears of the blocks --quantize applies to: all (attention, feed-forward and the norms' "
        "modulation linears), ffn or attention (default: all)",
    )


def quantization(args) -> Quantization:
    """The Quantization the flags ask for; --quantize_layers alone is refused (it would change nothing)."""
    if args.quantize == "none" and args.quantize_layers is not None:
        schemes = ", ".join(scheme for scheme in SCHEMES if scheme != "none")
        raise UserError(f"--quantize_layers {args.quantize_layers} acts only with --quantize ({schemes})")
    return Quantization(args.quantize, args.quantize_layers or "all")


def add_scan_flag(group) -> None:
    group.add_argument(
        "--scan_blocks",
        choices=SCAN_CHOICES,
        default="auto",
        help="run the transformer's identical blocks as one scan over stacked weights, so trace and compile "
        "time do not grow with depth (auto: wherever the blocks are identical, but for Wan VACE, whose scans "
        "hold more memory: on scans its blocks between two hints) (default: %(default)s)",
    )


def add_multihost_flags(parser) -> None:
    """Stage 2's flags for running as several processes (runtime.distributed.launch_settings takes them)."""
    group = parser.add_argument_group(
        "several hosts (one process per host; a Cloud TPU slice of several hosts needs none of these)"
    )
    group.add_argument(
        "--coordinator_address", metavar="HOST:PORT", help="process 0's address (or JAX_COORDINATOR_ADDRESS)"
    )
    group.add_argument("--num_processes", type=int, help="how many processes run this stage")
    group.add_argument("--process_id", type=int, help="this process's number, 0 to --num_processes - 1")
    group.add_argument(
        "--peer_timeout",
        type=finite_float,
        default=DEFAULT_PEER_TIMEOUT,
        help="seconds without a heartbeat from another process before this one stops with an error "
        "(default: %(default)s)",
    )
