"""Step caching for stage 2: MagCache and the interval cache, as at most two compiled programs per transformer.

Both caches replace the output of a span of transformer blocks by the span's input plus a residual
(output minus input) kept from the last step that computed it. Which steps reuse it is decided on the
host before the loop, from the step index and precomputed numbers only, so no device value is waited
for to choose the next program (models/cache_schedule.py):

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

Programs: `forward` is the full step; it also returns the span's new residual and, per branch, the
MagCache magnitude ratio (used when calibrating), and takes a per-branch `reuse` flag so that a state
that skips while its batch neighbour computes gets diffusers' result. `cached` is the cached step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from models.cache_schedule import CACHED, MAG_RATIOS_FILE, CacheSettings, schedule, schedule_text, state_names
from sharding import DP, SP
from utils import UserError, atomic_write, log, strict_json
from workarounds.diffusers import register_hunyuanvideo15_block

HIDDEN_LAYOUT = (DP, SP, None)  # the residuals' layouts: the blocks' own (batch on dp, video tokens on sp)
TEXT_LAYOUT = (DP, None, None)


# The device side -----------------------------------------------------------------------------------


class _Probed(Exception):
    """Raised while tracing the probe: the span's input shapes, found without compiling anything."""

    def __init__(self, shapes) -> None:
        super().__init__("probe")
        self.shapes = shapes


def block_list(transformer: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer's one list of blocks, found as diffusers' cache hooks find it."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    lists = [
        child
        for name, child in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
    ]
    if len(lists) != 1:
        raise ValueError(f"{type(transformer).__name__}: expected one list of transformer blocks, found {len(lists)}")
    return lists[0]


class BlockCache:
    """Installed on one transformer's blocks: while a CachedDenoiser method traces, the blocks of `span`
    (first, end) either run and report their residual (`full`) or are replaced by the cached one
    (`cached`). Outside those methods the blocks run as they are. `branches` equal chunks of the batch
    keep separate states (diffusers' cache contexts); `cache_text` also caches the text tokens' residual
    where the blocks return them (the interval cache; MagCache passes them through as diffusers does)."""

    def __init__(self, transformer, span: tuple[int, int], branches: int, cache_text: bool, constrain) -> None:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        register_hunyuanvideo15_block()
        blocks = block_list(transformer)
        self.metadata = TransformerBlockRegistry.get(type(blocks[0]))
        self.span = span
        self.branches = branches
        self.cache_text = cache_text and self.metadata.return_encoder_hidden_states_index is not None
        self.constrain = constrain
        self.mode = None
        for index, block in enumerate(blocks):
            block.forward = _BlockForward(self, index, block.forward)

    @contextlib.contextmanager
    def tracing(self, mode: str, state=(None, None), reuse=None):
        self.mode, self.state, self.reuse, self.found = mode, state, reuse, {}
        try:
            yield self.found
        finally:
            self.mode = self.state = self.reuse = None

    def _inputs(self, args, kwargs):
        meta = self.metadata
        hidden = meta._get_parameter_from_args_kwargs(meta.hidden_states_argument_name, args, kwargs)
        if meta.return_encoder_hidden_states_index is None:
            return hidden, None
        return hidden, meta._get_parameter_from_args_kwargs(meta.encoder_hidden_states_argument_name, args, kwargs)

    def _pack(self, hidden, text, output=None):
        meta = self.metadata
        if meta.return_encoder_hidden_states_index is None:
            return hidden
        values = list(output) if output is not None else [None] * 2
        values[meta.return_hidden_states_index] = hidden
        values[meta.return_encoder_hidden_states_index] = text
        return tuple(values)

    def block(self, index: int, forward, args, kwargs):
        first, end = self.span
        if self.mode is None or not first <= index < end:
            return forward(*args, **kwargs)
        hidden, text = self._inputs(args, kwargs)
        if self.mode == "probe":
            raise _Probed([(tuple(t.shape), t.dtype) if t is not None else None for t in (hidden, text)])
        if index == first:
            self.entry = (hidden, text)
        if self.mode == "cached":
            if index == first:
                hidden = hidden + self.state[0]
                text = text + self.state[1] if self.cache_text else text
            return self._pack(hidden, text)
        output = forward(*args, **kwargs)
        if index == end - 1:
            meta = self.metadata
            out_hidden = (
                output if meta.return_encoder_hidden_states_index is None else output[meta.return_hidden_states_index]
            )
            out_text = (
                None
                if meta.return_encoder_hidden_states_index is None
                else output[meta.return_encoder_hidden_states_index]
            )
            hidden, text = self._finish(out_hidden, out_text)
            output = self._pack(hidden, text, output)
        return output

    def _finish(self, out_hidden, out_text):
        """The span's new residuals, the magnitude ratios, and the output with reusing branches replaced."""
        entry_hidden, entry_text = self.entry
        previous_hidden, previous_text = self.state
        residual = self.constrain(out_hidden - entry_hidden, HIDDEN_LAYOUT)
        # MagCache calibration: mean over tokens of |residual| / |previous residual|, per branch
        norms = torch.linalg.norm(residual.float(), dim=-1) / (
            torch.linalg.norm(previous_hidden.float(), dim=-1) + 1e-8
        )
        self.found["ratios"] = norms.reshape(self.branches, -1).mean(-1)
        batch = residual.shape[0]
        reuse = self.reuse.reshape(self.branches, 1).expand(self.branches, batch // self.branches).reshape(batch, 1, 1)
        self.found["hidden"] = torch.where(reuse, previous_hidden, residual)
        hidden = torch.where(reuse, entry_hidden + previous_hidden, out_hidden)
        text = out_text
        if out_text is not None:
            text = torch.where(reuse, entry_text, out_text)  # diffusers' skip returns the text tokens unchanged
        if self.cache_text:
            text_residual = self.constrain(out_text - entry_text, TEXT_LAYOUT)
            self.found["text"] = torch.where(reuse, previous_text, text_residual)
        return hidden, text


class _BlockForward:
    """A block's forward routed through its BlockCache (an object, so the block's state dict is unchanged)."""

    def __init__(self, cache: BlockCache, index: int, forward) -> None:
        self.cache, self.index, self.forward = cache, index, forward

    def __call__(self, *args, **kwargs):
        return self.cache.block(self.index, self.forward, args, kwargs)


class CachedDenoiser(torch.nn.Module):
    """A guided denoiser (the family's module) with a step cache. `forward(hidden_residual, text_residual,
    reuse, *inputs)` is the full step: (noise prediction, (new residuals), per-branch ratios).
    `cached(hidden_residual, text_residual, *inputs)` is the cached step. `probe(*inputs)` only traces up
    to the span (raises _Probed with its input shapes). The guided module is the only child, so
    parameter names are the guided module's under `guided.`."""

    def __init__(self, guided: torch.nn.Module, cache: BlockCache) -> None:
        super().__init__()
        self.guided = guided
        self.cache = cache

    def forward(self, hidden_residual, text_residual, reuse, *inputs):
        with self.cache.tracing("full", (hidden_residual, text_residual), reuse) as found:
            noise = self.guided(*inputs)
        return noise, (found["hidden"], found.get("text")), found["ratios"]

    def cached(self, hidden_residual, text_residual, *inputs):
        with self.cache.tracing("cached", (hidden_residual, text_residual)):
            return self.guided(*inputs)

    def probe(self, *inputs):
        with self.cache.tracing("probe"):
            self.guided(*inputs)
        raise RuntimeError("the cached span's first block was never called")


def cache_span(kind: str, blocks: int) -> tuple[int, int]:
    """The blocks whose residual is cached: all of them (MagCache), or all but the first and the last
    (the interval cache's outer blocks, which every step runs)."""
    if kind == "interval":
        if blocks < 3:
            raise UserError(
                f"--cache interval needs at least 3 transformer blocks (outer, deep, outer); this model has {blocks}"
            )
        return 1, blocks - 1
    return 0, blocks


def cached_denoiser(guided, settings: CacheSettings, branches: int, constrain) -> CachedDenoiser:
    """Wrap a family's guided denoiser (its transformer is `guided.transformer`)."""
    kind = "magcache" if settings.calibrate else settings.kind
    span = cache_span(kind, len(block_list(guided.transformer)))
    return CachedDenoiser(guided, BlockCache(guided.transformer, span, branches, kind == "interval", constrain))


def is_batched_state(key: str) -> bool:
    """A checkpoint key of the device state (`cache.<expert>.hidden` or `.text`): residuals laid out along
    the transformer's batch, which a batch of videos splits per video (models/batching.py)."""
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "cache" and parts[1].isdigit()


def probe_shapes(call) -> list:
    """Run `call` (which traces a CachedDenoiser.probe) and return the span's input shapes."""
    try:
        call()
    except _Probed as found:
        return found.shapes
    raise RuntimeError("the probe did not reach the cached span")


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
        models/batching.py) starts here with the same programs."""
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
        """Zero residuals of the span's input shapes (found by tracing the probe; nothing is compiled)."""
        hidden, text = probe_shapes(lambda: self.programs[expert].probe(*inputs))
        zeros = self.runtime.to_device(torch.zeros(hidden[0], dtype=hidden[1]), HIDDEN_LAYOUT)
        if not self.modules[expert].cache.cache_text:
            return zeros, None
        return zeros, self.runtime.to_device(torch.zeros(text[0], dtype=text[1]), TEXT_LAYOUT)

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

    def write_ratios(self, directory: Path, model_id: str, adapters: list | None = None) -> Path:
        """--cache_calibrate: the magnitude ratios of every state, for later --cache magcache runs (of the same
        model and LoRA adapters, models.lora.identity)."""
        path = directory / MAG_RATIOS_FILE
        data = {"model": model_id, "num_inference_steps": len(self.experts), "mag_ratios": self.ratios}
        if adapters:
            data["adapters"] = adapters
        atomic_write(path, lambda tmp: tmp.write_text(strict_json(data, indent=1) + "\n"))
        log(f"wrote {path}: magnitude ratios for {', '.join(self.ratios)}")
        return path
