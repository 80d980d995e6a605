"""Step caching for stage 2: MagCache and the interval cache, as at most two compiled programs per transformer.

Both caches replace the output of a span of transformer blocks by the span's input plus a residual
(output minus input) kept from the last step that computed it. Which steps reuse it is decided on the
host before the loop, from the step index and precomputed numbers only, so no device value is waited
for to choose the next program (tpu_video/engine/cache_schedule.py):

- `magcache`: diffusers' MagCache (hooks/mag_cache.py) over every block of the transformer: a step is
  skipped while the accumulated error of the magnitude ratios stays under a threshold. diffusers keeps
  one cache state per `cache_context` (CogVideoX: its batched call; Wan and HunyuanVideo-1.5: the cond
  and uncond branches, which we run as one batch) and per hooked transformer (Wan 2.2's experts); so do
  we. Each state counts its own calls and is configured over the steps its transformer runs.
- `interval`: the reference scripts' cache. Step i computes everything when i < start, i >= end or
  (i - start) % interval == 0; the other steps run only the outer blocks, the first and the last, and
  reuse the residual of the deep ones in between. The first block turns the step's new input and
  timestep into the deep blocks' input; the last one feeds the output projection, so both keep the step
  its own (DeepCache's split: shallow features change from step to step, deep ones slowly).

The compiled programs (the device side) are in tpu_video/engine/cached_blocks.py; this module runs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tpu_video.cli import log
from tpu_video.engine.cache_schedule import CACHED, CacheSettings, schedule, schedule_text, state_names
from tpu_video.engine.cached_blocks import HIDDEN_LAYOUT, TEXT_LAYOUT, cached_denoiser, probe_shapes
from tpu_video.engine.mag_ratios import MAG_RATIOS_FILE
from utils import atomic_write, strict_json


def is_batched_state(key: str) -> bool:
    """A checkpoint key of the device state (`cache.<expert>.hidden` or `.text`): residuals laid out along
    the transformer's batch, which a batch of videos splits per video (tpu_video/engine/batching.py)."""
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "cache" and parts[1].isdigit()


def cached_rules(rules):
    """The transformer's rule table as it applies inside a cached denoiser, which holds the family's guided
    module as `guided` (and its transformer as `guided.transformer`)."""
    return rules.nested("guided.transformer.")


def zero_state(module, trace_probe) -> list[tuple[torch.Tensor | None, tuple]]:
    """A cached denoiser's state at the start, as host tensors with their layouts: zero residuals of the span's
    input shapes (found by `trace_probe()`, which traces the module's probe; nothing is compiled), the text
    residual None where the cache keeps none. A run places them; `--plan` compiles over their shapes."""
    hidden, text = probe_shapes(trace_probe)
    state = [(torch.zeros(hidden[0], dtype=hidden[1]), HIDDEN_LAYOUT)]
    state.append((torch.zeros(text[0], dtype=text[1]), TEXT_LAYOUT) if module.cache.cache_text else (None, ()))
    return state


class StepCache:
    """One stage-2 run's cache: the schedule, the compiled programs and the device state per transformer."""

    def __init__(self, settings: CacheSettings, loop, runtime, rules) -> None:
        self.settings = settings
        self.runtime = runtime
        self.experts = [loop.expert(i, t) for i, t in enumerate(loop.timesteps)]
        self.names = loop.expert_names
        self.branches = loop.cache_branches
        self.plan = schedule(settings, self.experts, self.names, self.branches)
        self.modules = [cached_denoiser(g, settings, len(self.branches), runtime.constrain) for g in loop.guided]
        self.programs = [runtime.compile(m, rules, methods=("forward", "cached", "probe")) for m in self.modules]
        self.reset()

    def reset(self) -> None:
        """Forget the device state, the calibration and the step kinds: a new video (or batch of videos,
        tpu_video/engine/batching.py) starts here with the same programs."""
        self.state: dict[int, tuple] = {}
        self.ratios = {name: [] for name in state_names(self.names, self.branches)}
        self.kinds: list[str] = []

    def describe(self) -> str:
        letters = schedule_text(self.plan)
        reused = letters.count(CACHED)
        return (
            f"step cache {self.record()['kind']}: {len(letters) - reused} computed, {reused} cached steps "
            f"(F full, C cached, P some branch reuses): {letters}"
        )

    def _zero_state(self, expert: int, inputs) -> tuple:
        state = zero_state(self.modules[expert], lambda: self.programs[expert].trace_ahead("probe", inputs))
        return tuple(None if tensor is None else self.runtime.to_device(tensor, layout) for tensor, layout in state)

    def _state_for(self, expert: int, inputs) -> tuple:
        if expert not in self.state:
            self.state[expert] = self._zero_state(expert, inputs)
        return self.state[expert]

    def warmup(self, expert: int, inputs) -> None:
        """Compile this expert's programs (results discarded, the cache state untouched)."""
        state = self._state_for(expert, inputs)
        reuse = self.runtime.to_device(torch.zeros(len(self.branches), dtype=torch.bool))
        self.runtime.to_host(self.programs[expert](*state, reuse, *inputs)[0])
        if any(all(r) for r, e in zip(self.plan, self.experts, strict=True) if e == expert):
            self.runtime.to_host(self.programs[expert].cached(*state, *inputs))

    def __call__(self, i: int, inputs):
        """Step i's noise prediction (on the host), from the full or the cached program as scheduled."""
        expert, reuse = self.experts[i], self.plan[i]
        state = self._state_for(expert, inputs)
        if all(reuse):
            self.kinds.append("cached")
            return self.runtime.to_host(self.programs[expert].cached(*state, *inputs))
        self.kinds.append("full")
        flags = self.runtime.to_device(torch.tensor(reuse, dtype=torch.bool))
        noise, self.state[expert], ratios = self.programs[expert](*state, flags, *inputs)
        noise = self.runtime.to_host(noise)
        if self.settings.calibrate:
            first = self.experts.index(expert) == i  # its first call has no previous residual
            values = [1.0] * len(self.branches) if first else self.runtime.to_host(ratios).tolist()
            for branch, value in zip(self.branches, values, strict=True):
                self.ratios[f"{self.names[expert]}.{branch}"].append(value)
        return noise

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The device state and the calibration so far, as host tensors for a checkpoint."""
        tensors = {}
        for expert, (hidden, text) in self.state.items():
            tensors[f"cache.{expert}.hidden"] = self.runtime.to_host(hidden)
            if text is not None:
                tensors[f"cache.{expert}.text"] = self.runtime.to_host(text)
        for name, values in self.ratios.items():
            if values:
                tensors[f"cache.ratios.{name}"] = torch.tensor(values, dtype=torch.float64)
        return tensors

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what `checkpoint` saved (the keys are removed from `tensors`)."""
        for expert in range(len(self.modules)):
            if f"cache.{expert}.hidden" in tensors:
                hidden = self.runtime.to_device(tensors.pop(f"cache.{expert}.hidden"), HIDDEN_LAYOUT)
                text = tensors.pop(f"cache.{expert}.text", None)
                self.state[expert] = (hidden, self.runtime.to_device(text, TEXT_LAYOUT) if text is not None else None)
        for name in self.ratios:
            if f"cache.ratios.{name}" in tensors:
                self.ratios[name] = tensors.pop(f"cache.ratios.{name}").tolist()

    def record(self) -> dict[str, Any]:
        letters = schedule_text(self.plan)
        reused = {name: [] for name in state_names(self.names, self.branches)}
        for i, (expert, reuse) in enumerate(zip(self.experts, self.plan, strict=True)):
            for branch, skip in zip(self.branches, reuse, strict=True):
                if skip:
                    reused[f"{self.names[expert]}.{branch}"].append(i)
        return {
            **self.settings.record(),
            "schedule": letters,
            "reused_steps": reused,  # per cache state, the steps that reused its residual
            "computed_steps": len(letters) - letters.count(CACHED),
            "cached_steps": letters.count(CACHED),
        }

    def write_ratios(self, directory: Path, model_id: str, adapters: list | None = None, quantize=None) -> Path:
        """--cache_calibrate: the magnitude ratios of every state, for later --cache magcache runs (of the same
        model, LoRA adapters (engine.lora.identity) and quantization (Quantization.calibration_key))."""
        path = directory / MAG_RATIOS_FILE
        data = {"model": model_id, "num_inference_steps": len(self.experts), "mag_ratios": self.ratios}
        if adapters:
            data["adapters"] = adapters
        if quantize:
            data["quantize"] = quantize
        atomic_write(path, lambda tmp: tmp.write_text(strict_json(data, indent=1) + "\n"))
        log(f"wrote {path}: magnitude ratios for {', '.join(self.ratios)}")
        return path
