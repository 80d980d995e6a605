"""Step caching, the host side: the cache flags and which steps reuse the cache (MagCache's ratios files:
tpu_video/engine/mag_ratios.py).

The schedule depends only on the step index and precomputed numbers, so it is fixed before the loop
starts and no device value is waited for to pick a step's program (tpu_video/engine/step_cache.py runs them).
MagCache's decisions are diffusers' (hooks/mag_cache.py: MagCacheHeadHook), made per cache state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError, finite_float, log
from tpu_video.engine.mag_ratios import MAG_RATIOS_FILE, read_mag_ratios

KINDS = ("none", "magcache", "interval")
FULL, CACHED, PARTIAL = "F", "C", "P"  # schedule letters: full step, cached step, full step some branch skips


# Settings and the host-side schedule ---------------------------------------------------------------


@dataclass(frozen=True)
class CacheSettings:
    """Stage 2's cache flags. MagCache's three numbers have diffusers' meaning and defaults."""

    kind: str = "none"
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: Any = None  # a list of numbers (every state) or {state name: list}
    calibrate: bool = False
    start_step: int = 11
    end_step: int = 45
    step_interval: int = 4

    @property
    def enabled(self) -> bool:
        return self.kind != "none" or self.calibrate

    def record(self) -> dict[str, Any]:
        """What the config and the checkpoint fingerprint say about the cache."""
        if self.kind == "interval":
            keys = ("kind", "start_step", "end_step", "step_interval")
        else:
            keys = ("kind", "threshold", "max_skip_steps", "retention_ratio", "mag_ratios", "calibrate")
        values = asdict(self)
        if self.calibrate:
            values["kind"] = "magcache"
        return {key: values[key] for key in keys}


def state_names(expert_names, branches) -> list[str]:
    """Each cache state's name: transformer component and diffusers' cache_context, e.g. transformer.cond."""
    return [f"{expert}.{branch}" for expert in expert_names for branch in branches]


def check_window(settings: CacheSettings, steps: int) -> None:
    """The interval cache's window within the run's steps (checked again by stage 2 before any weights load)."""
    start, end, interval = settings.start_step, settings.end_step, settings.step_interval
    if settings.kind == "interval" and (interval < 1 or not 0 <= start < end <= steps):
        raise UserError(
            f"--cache_start_step {start}, --cache_end_step {end} and --cache_step_interval {interval} do not "
            f"fit {steps} steps: need 0 <= start < end <= {steps} and an interval >= 1"
        )


def schedule(settings: CacheSettings, experts: list[int], expert_names, branches) -> list[tuple[bool, ...]]:
    """For each step, per branch: does it reuse the cache? `experts[i]` is step i's transformer."""
    steps = len(experts)
    if settings.calibrate or settings.kind == "none":
        return [(False,) * len(branches) for _ in experts]
    if settings.kind == "interval":
        check_window(settings, steps)
        start, end, interval = settings.start_step, settings.end_step, settings.step_interval
        seen, plan = set(), []
        for i, expert in enumerate(experts):
            full = i < start or i >= end or (i - start) % interval == 0 or expert not in seen  # no residual yet
            seen.add(expert)
            plan.append((not full,) * len(branches))
        return plan
    states = {}
    for e, name in enumerate(expert_names):
        calls = experts.count(e)
        for b, branch in enumerate(branches):
            if calls:
                states[e, b] = _MagCacheState(settings, _ratios_for(settings.mag_ratios, f"{name}.{branch}"), calls)
    return [tuple(states[e, b].decide() for b in range(len(branches))) for e in experts]


def _ratios_for(mag_ratios, name: str) -> list[float]:
    if mag_ratios is None:
        raise UserError(
            "--cache magcache needs magnitude ratios: --cache_mag_ratios FILE (--cache_calibrate writes one)"
        )
    if isinstance(mag_ratios, dict):
        if name not in mag_ratios:
            raise UserError(f"--cache_mag_ratios has no ratios for {name} (it has {', '.join(mag_ratios)})")
        return mag_ratios[name]
    return mag_ratios


class _MagCacheState:
    """The decision half of diffusers' MagCacheHeadHook for one cache state, on the host: the same
    MagCacheConfig (which interpolates the ratios to the step count) and the same arithmetic."""

    def __init__(self, settings: CacheSettings, ratios: list[float], calls: int) -> None:
        from diffusers.hooks.mag_cache import MagCacheConfig

        self.config = MagCacheConfig(
            threshold=settings.threshold,
            max_skip_steps=settings.max_skip_steps,
            retention_ratio=settings.retention_ratio,
            num_inference_steps=calls,
            mag_ratios=list(ratios),
        )
        self.step, self.computed = 0, False
        self.ratio, self.err, self.skipped = 1.0, 0.0, 0

    def decide(self) -> bool:
        config, skip = self.config, False
        scale = config.mag_ratios[self.step] if self.step < len(config.mag_ratios) else 1.0
        if self.step >= int(config.retention_ratio * config.num_inference_steps + 0.5):
            self.ratio *= scale
            self.skipped += 1
            self.err += abs(1.0 - self.ratio)
            if self.computed and self.err <= config.threshold and self.skipped <= config.max_skip_steps:
                skip = True
            else:
                self.ratio, self.skipped, self.err = 1.0, 0, 0.0
        self.computed |= not skip
        self.step += 1
        return skip


def schedule_text(plan: list[tuple[bool, ...]]) -> str:
    """One letter per step: F full, C cached, P full with some branch reusing its cache."""
    return "".join(CACHED if all(reuse) else PARTIAL if any(reuse) else FULL for reuse in plan)


# From stage 2's flags -------------------------------------------------------------------------------


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


def kind_from_flags(args) -> str:
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


def check_family_runs(family, args) -> None:
    """The cache the flags ask for must be one the family runs (Family.STEP_CACHES); checked before any
    magnitude ratios are looked for, and by --plan too."""
    kind = kind_from_flags(args)
    if kind != "none" and kind not in family.STEP_CACHES:
        flag = "--cache_calibrate" if args.cache_calibrate else f"--cache {kind}"
        runs = " or ".join(f"--cache {name}" for name in family.STEP_CACHES)
        raise UserError(f"{flag}: {family.NAME} runs {runs} only (docs/caching.md)")


def settings_from_flags(
    args, input_dir: Path, model_id: str, adapters: list | None = None, quantize: dict | None = None
) -> CacheSettings:
    """The step cache from the flags (checked by kind_from_flags), with MagCache's ratios read (calibrated
    for this model, these LoRA adapters and this quantization)."""
    kind = kind_from_flags(args)
    values = {
        key: getattr(args, flag)
        for key, flag in {**MAGCACHE_FLAGS, **INTERVAL_FLAGS}.items()
        if getattr(args, flag) is not None
    }
    if kind == "magcache" and not args.cache_calibrate:
        path = Path(args.cache_mag_ratios) if args.cache_mag_ratios else input_dir / MAG_RATIOS_FILE
        if not args.cache_mag_ratios and not path.is_file():
            raise UserError(
                f"--cache magcache needs the model's magnitude ratios: --cache_mag_ratios FILE, or a "
                f"{MAG_RATIOS_FILE} in {input_dir} (write one with --cache_calibrate)"
            )
        values["mag_ratios"] = read_mag_ratios(path, model_id, adapters, quantize)
        log(f"MagCache ratios from {path}")
    return CacheSettings(kind=kind, calibrate=args.cache_calibrate, **values)


CACHE_DEFAULTS = CacheSettings()  # the cache flags' defaults, stated once (diffusers' for MagCache)


def add_cache_arguments(parser) -> None:
    """Stage 2's step-cache flags (read back by settings_from_flags)."""
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
