"""Step caching, the host side: the settings (stage 2's flags read by tpu_video/stages/feature_flags.py)
and which steps reuse the cache (MagCache's ratios files: tpu_video/engine/mag_ratios.py).

The schedule depends only on the step index and precomputed numbers, so it is fixed before the loop
starts and no device value is waited for to pick a step's program (tpu_video/engine/step_cache.py runs them).
MagCache's decisions are diffusers' (hooks/mag_cache.py: MagCacheHeadHook), made per cache state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tpu_video.cli import UserError

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


def check_family_runs(family, settings: CacheSettings) -> None:
    """The cache asked for must be one the family runs (Family.STEP_CACHES); checked before any magnitude
    ratios are looked for, and by --plan too."""
    if settings.kind != "none" and settings.kind not in family.STEP_CACHES:
        flag = "--cache_calibrate" if settings.calibrate else f"--cache {settings.kind}"
        runs = " or ".join(f"--cache {name}" for name in family.STEP_CACHES)
        raise UserError(f"{flag}: {family.NAME} runs {runs} only (docs/caching.md)")
