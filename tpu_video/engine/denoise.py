"""Stage 2's denoising loop, shared by every family: placing the guided denoiser, warmup, the timed steps
with their progress bar; a guard (tpu_video/engine/guard.py) checks every step for NaN/Inf, checkpoints and resumes.

A family's `denoise_loop` returns a `DenoiseLoop` (its guided transformer, inputs, scheduler step);
`denoise` (one video) and tpu_video/engine/batching.py (a batch) run it through `run_denoise_loop`. The scheduler
stays in PyTorch on the host, exactly as the pipelines run it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sharding import Layout
from tpu_video.cli import UserError, log, logging_enabled
from tpu_video.engine import scanned_blocks, segments
from tpu_video.engine.cache_schedule import CacheSettings
from tpu_video.engine.direct_load import load_direct
from tpu_video.engine.guard import DenoiseGuard
from tpu_video.engine.passes import started
from tpu_video.engine.quantize import quantize
from tpu_video.engine.settings import Quantization
from tpu_video.engine.step_cache import StepCache, cached_rules
from tpu_video.runtime.interface import Runtime, Timer

LATENTS_LAYOUT = "BCFHW"  # stage 2's latents file, for every family
# Stage 2's initial noise is drawn in fp32 on the CPU and then cast to the run's dtype, so a seed gives
# the same latents on every host: torch 2.11's CPU randn draws another sequence in bf16 than in fp32
# (torch 2.13 draws the fp32 values, rounded), while its fp32 draws equal torch 2.13's (checked on the
# GPU host, whose torch is 2.11). The pipelines draw in the run's dtype; on torch 2.13 that is the same.
NOISE_DTYPE = torch.float32


@dataclass(frozen=True)
class DenoiseOptions:
    """Stage 2's run options that every family's denoise takes."""

    tp_mode: str = "megatron"
    warmup_steps: int = 0
    guard: DenoiseGuard | None = None
    cache: CacheSettings = CacheSettings()
    scan_blocks: str = "auto"  # tpu_video/engine/scanned_blocks.py
    # Run on the loaded transformers (by component name) before anything is placed: stage 2 fuses its
    # LoRA adapters there (tpu_video/engine/lora.py).
    on_loaded: Callable[[dict[str, torch.nn.Module]], None] | None = None
    quantization: Quantization = Quantization()  # applied after on_loaded (tpu_video/engine/quantize.py)


def load_transformers(family, source, dtype: torch.dtype, options: DenoiseOptions, timer: Timer):
    """The family's stage-2 transformers by component name, as the loop runs them: loaded, with `on_loaded`
    run on them (LoRA fused), then quantized (timed as `load` and `quantize`). Where neither changes the
    weights, they are not read here but at placement, straight to the devices (tpu_video/engine/direct_load.py)."""
    direct = options.on_loaded is None and not options.quantization.enabled
    with timer.phase("load"):
        transformers = {}
        for name in family.transformer_components(source):
            module = load_direct(source, name, dtype) if direct else None
            transformers[name] = module if module is not None else _loaded_whole(source, name, dtype)
        if options.on_loaded is not None:
            options.on_loaded(transformers)
    if options.quantization.enabled:
        with timer.phase("quantize"):
            quantize(transformers, options.quantization)
    return transformers


def _loaded_whole(source, component: str, dtype: torch.dtype) -> torch.nn.Module:
    """`from_pretrained`'s module, every weight read: it leaves the weights a checkpoint lacks on the meta device
    (a key missing, a config with more layers than the weights), which only placement would find."""
    module = source.load(component, dtype=dtype).eval()
    empty = [name for name, tensor in module.state_dict().items() if tensor.is_meta]
    if empty:
        raise UserError(
            f"{component} of {source.ref!r}: the checkpoint has no values for {', '.join(empty[:3])}"
            f"{f' and {len(empty) - 3} more' if len(empty) > 3 else ''}: it is incomplete or of another configuration"
        )
    return module


@dataclass
class DenoiseLoop:
    """What a family prepares for the shared loop.

    `guided` holds one denoiser evaluation per transformer (the transformer, as attribute `transformer`,
    on the CFG batch plus the guidance combination, as one graph), called as `guided[e](latents, t,
    *static_inputs)`; `expert(i, t)` picks `e` for step i (Wan 2.2's two experts; others have one).
    `rules` is the transformers' rule table. `step(i, t, noise_pred, latents, carry)` returns
    (latents, carry): the scheduler's step, with `carry` holding its extra tensors (e.g. DPM's previous
    prediction) that a checkpoint must keep. `timestep_input(i, t)` is the denoiser's timestep input (a
    1-vector; HunyuanVideo-1.5's step-distilled checkpoints add the next step's) and `model_input(latents,
    t)` its latents input (e.g. the scheduler's input scaling); `on_start(step, carry)` runs once before the
    first computed step, with the carry a checkpoint restored. `expert_names` are the transformers'
    component names and `cache_branches` the names of the equal batch chunks that diffusers runs in
    separate cache contexts (the step cache keeps one state per expert and branch). `noise_state`: the
    generator's state before the loop drew its initial noise, where its sampler draws from the generator
    while stepping (a pass from given latents goes on from it: the pipeline's `latents=` path draws none).
    `then(latents)`: the video's next loop, built from this one's final latents (Wan Animate's next segment:
    tpu_video/engine/segments.py); None for a video's last. `between_plan(runtime)`, for `--plan` where `then` is
    set: the programs the work between two loops compiles, (module, {method: its (tensor, layout) inputs},
    {method: its calls}, the attention plan). `label` names the loop in the progress bar and the guard's
    messages where a video has several ("segment 2 of 3").
    """

    guided: tuple[torch.nn.Module, ...]
    rules: Any
    static_inputs: tuple[tuple[torch.Tensor, Layout], ...]
    timesteps: torch.Tensor
    latents: torch.Tensor
    generator: torch.Generator
    step: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]
    model_input: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda latents, t: latents
    on_start: Callable[[int, dict], None] = lambda step, carry: None
    carry: dict[str, torch.Tensor] = field(default_factory=dict)
    expert: Callable[[int, torch.Tensor], int] = lambda i, t: 0
    expert_names: tuple[str, ...] = ("transformer",)
    timestep_input: Callable[[int, torch.Tensor], torch.Tensor] = lambda i, t: t.reshape(1)
    cache_branches: tuple[str, ...] = ("batch",)
    noise_state: torch.Tensor | None = None
    then: Callable[[torch.Tensor], DenoiseLoop] | None = None
    label: str = ""
    between_plan: Callable[[Any], tuple[torch.nn.Module, dict, dict, Any]] | None = None

    def experts_used(self) -> list[int]:
        return sorted({self.expert(i, t) for i, t in enumerate(self.timesteps)})


def step_progress(steps, timer: Timer, desc: str = "denoise", trace=None, trace_steps: int = 3, label: str = ""):
    """Yield (index, step) under a tqdm bar (`desc`, and `label` where given) showing the last step's seconds, the
    running mean and ETA; the steps are timed as the phase `desc`.

    A step's time runs from one yield to the next, so it includes the device sync the caller does when
    it pulls the step's result back to the host. `trace` (a context manager, e.g. a profiler trace) is
    held open around the first `trace_steps` steps.
    """
    from tqdm import tqdm

    tracing = contextlib.ExitStack()
    shown = f"{desc} {label}" if label else desc
    bar = tqdm(total=len(steps), desc=shown, unit="step", dynamic_ncols=True, disable=not logging_enabled())
    with timer.phase(desc), tracing:
        for index, step in enumerate(steps):
            if index == 0 and trace is not None:
                tracing.enter_context(trace)
            start = time.perf_counter()
            yield index, step
            timer.step_seconds.append(round(time.perf_counter() - start, 4))
            if index + 1 == trace_steps:
                tracing.close()
            mean = sum(timer.step_seconds) / len(timer.step_seconds)
            bar.set_postfix_str(f"step {timer.step_seconds[-1]:.3f}s avg {mean:.3f}s")
            bar.update()
    bar.close()


def place_denoisers(loop: DenoiseLoop, runtime: Runtime, options: DenoiseOptions) -> list | StepCache:
    """The guided denoisers placed and jitted (every expert's weights placed once): one program per expert,
    or the step cache's programs. Later loops of the same group (tpu_video/engine/batching.py) reuse them."""
    rules = scanned_blocks.install(loop, options.scan_blocks, options.cache, runtime.scan)
    if options.cache.enabled:
        return StepCache(options.cache, loop, runtime, cached_rules(rules))
    return [runtime.compile(guided, rules.nested("transformer.")) for guided in loop.guided]


def run_denoise_loop(
    loop: DenoiseLoop, runtime: Runtime, timer: Timer, options: DenoiseOptions, placed=None, restore: bool = True
):
    """Place and compile the guided denoisers (unless `placed` holds them already), warm each up, then run
    (or, with `restore`, resume from the guard's checkpoint) the timed steps; the final latents on the host, and
    the step cache (or None)."""
    with timer.phase("place"):
        if placed is None:
            placed = place_denoisers(loop, runtime, options)
        cache, denoisers = (placed, None) if isinstance(placed, StepCache) else (None, placed)
        if cache is not None:
            cache.reset()  # placed for an earlier batch of the group: its residuals are that batch's
        static_inputs = tuple(runtime.to_device(tensor, layout) for tensor, layout in loop.static_inputs)

    def predict_noise(latents, i, t, expert, warmup=False):
        """One denoiser evaluation; the real loop and the warmup both run exactly this."""
        inputs = (*runtime.to_device((loop.model_input(latents, t), loop.timestep_input(i, t))), *static_inputs)
        if cache is not None:
            return cache.warmup(expert, inputs) if warmup else cache(i, inputs)
        return runtime.to_host(denoisers[expert](*inputs))  # to_host waits for the device

    latents, carry, timesteps = loop.latents, dict(loop.carry), loop.timesteps
    if options.warmup_steps:
        with timer.phase("warmup"):  # the first call builds the programs (timed apart); results are discarded
            for expert in loop.experts_used():
                for _ in range(options.warmup_steps):
                    predict_noise(latents, 0, timesteps[0], expert, warmup=True)

    guard = options.guard
    start = 0
    if restore and guard is not None and guard.restored is not None:  # --resume: the loop state after step `start`
        start, state = guard.restored
        state = dict(state)
        latents = state.pop("latents")
        loop.generator.set_state(state.pop("generator_state"))
        if cache is not None:
            cache.restore(state)
        carry.update(state)
        log(f"resuming after step {start} of {len(timesteps)}{f' in {loop.label}' if loop.label else ''}")
    loop.on_start(start, carry)
    if cache is not None:
        log(cache.describe())

    steps = list(enumerate(timesteps))[start:]
    for _, (i, t) in step_progress(steps, timer, trace=runtime.profile_trace(), label=loop.label):
        noise_pred = predict_noise(latents, i, t, loop.expert(i, t))
        latents, carry = loop.step(i, t, noise_pred, latents, carry)
        if guard is not None:
            state = {"latents": latents, "generator_state": loop.generator.get_state(), **carry}
            more = cache.checkpoint if cache is not None else dict
            guard.after_step(i, len(timesteps), state, more=more, where=loop.label)
    if cache is not None:
        timer.step_kinds += cache.kinds  # one per timed step ("full" or "cached"), a video's loops in order
    return latents, cache


def denoise(
    family,
    source,
    request,
    embeds,
    dtype: torch.dtype,
    runtime: Runtime,
    timer: Timer,
    options: DenoiseOptions,
    start_latents: torch.Tensor | None = None,
):
    """Stage 2 for any family: load the transformer(s), run the family's loop (from `start_latents`, a later
    pass's, where given: engine/passes.py); returns (stage 2's tensors by name, `latents` first; the record;
    the run's StepCache or None)."""
    transformers = load_transformers(family, source, dtype, options, timer)
    loop, finish = family.denoise_loop(
        source, request, embeds, dtype, transformers, runtime, options.tp_mode, planning=False
    )
    loops, finished = segments.resumed([started(loop, start_latents)], [options.guard], timer)
    with timer.phase("place"):
        placed = place_denoisers(loops[0], runtime, options)
    run = functools.partial(run_denoise_loop, runtime=runtime, timer=timer, placed=placed)
    latents, cache = segments.run_in_order(loops, finished, lambda loops: loops[0], run, options, timer)
    tensors, record = finish(latents)
    return tensors, {**record, **scanned_blocks.record(loops[0], options.scan_blocks)}, cache


def latents_record(scheduler, do_cfg: bool, normalization: dict[str, Any], **extra) -> dict[str, Any]:
    """What stage 2's section says about its latents: the layout and how they are normalised relative to
    the VAE's latents (stage 3 undoes exactly that, never guesses; the family's `latents_normalization`)."""
    return {
        "latents_layout": LATENTS_LAYOUT,
        "latents_normalization": normalization,
        **extra,
        "scheduler": type(scheduler).__name__,
        "classifier_free_guidance": do_cfg,
    }


# Multistep schedulers (UniPC, DPM-Solver++ multistep) keep a history of model outputs between steps.
_HISTORY_LISTS = ("model_outputs", "timestep_list")
_HISTORY_TENSORS = ("last_sample",)
_HISTORY_INTS = ("lower_order_nums", "this_order")


def multistep_state(scheduler) -> dict[str, torch.Tensor]:
    """A scheduler's step history as named tensors (for checkpoints); empty for single-step schedulers."""
    state = {}
    for name in _HISTORY_LISTS:
        for index, value in enumerate(getattr(scheduler, name, None) or ()):
            if value is not None:
                state[f"scheduler.{name}.{index}"] = torch.as_tensor(value)
    for name in _HISTORY_TENSORS:
        if getattr(scheduler, name, None) is not None:
            state[f"scheduler.{name}"] = getattr(scheduler, name)
    for name in _HISTORY_INTS:
        if getattr(scheduler, name, None) is not None:
            state[f"scheduler.{name}"] = torch.tensor(int(getattr(scheduler, name)))
    return state


def restore_multistep_state(scheduler, state: dict[str, torch.Tensor]) -> None:
    """Put back what multistep_state saved (after set_timesteps); keys it does not name are left alone."""
    for name in _HISTORY_LISTS:
        values = getattr(scheduler, name, None)
        for index in range(len(values or ())):
            values[index] = state.get(f"scheduler.{name}.{index}")
    for name in _HISTORY_TENSORS:
        if f"scheduler.{name}" in state:
            setattr(scheduler, name, state[f"scheduler.{name}"])
    for name in _HISTORY_INTS:
        if f"scheduler.{name}" in state:
            setattr(scheduler, name, int(state[f"scheduler.{name}"]))
