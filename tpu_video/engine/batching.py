"""Several videos denoised as one batch, each exactly as if run alone.

Every video gets its own `DenoiseLoop` from its family (its noise from its seed, its scheduler, generator
and image inputs); `batched_loop` joins them into one loop for the shared loop runner. Only the transformer
call is batched: its latents and per-video inputs are concatenated along the batch (a CFG-doubled input
keeps the pipelines' order, every video's first branch then every video's second, which is what the
guided transformer's doubled latents line up with; an image's conditioning, one per video, joins the
latents before the doubling, and image embeddings are repeated for both branches), and each video's
scheduler then steps its own slice on the host with its own generator and history. The videos of one
batch must agree on everything the compiled program and the schedule depend on (`group_key`), so inputs
shared by all (rotary tables, the guidance scale, per-token timesteps) are taken from the first and
checked equal.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from sharding import DP
from tpu_video.cli import log
from tpu_video.runtime.interface import Timer

from . import scanned_blocks, segments
from .denoise import DenoiseLoop, DenoiseOptions, load_transformers, place_denoisers, run_denoise_loop
from .passes import started
from .step_cache import is_batched_state

# The shared request fields a batch's videos share: the compiled program and the timestep schedule depend
# on them (and on the family options declared `splits_batch`).
GROUP_FIELDS = (
    "model_id",
    "dtype",
    "height",
    "width",
    "num_frames",
    "fps",  # LTX-2: the soundtrack's length and the RoPE positions
    "num_inference_steps",
    "guidance_scale",
    "flow_shift",
)


def group_key(request, options, task: str, cache_record: dict, embeddings: dict) -> tuple:
    """What must be equal for two videos to share a batch: the request's schedule and shape fields, the family
    `options` (its declarations) that split batches, the task (t2v, i2v, ...), the step-cache settings and
    the stage-1 tensors' shapes (joined along the batch: a VACE run's reference frames lengthen its own)."""
    fields = tuple((name, getattr(request, name)) for name in GROUP_FIELDS)
    values = [(option.name, request.option(option.name)) for option in options if option.splits_batch]
    fields += tuple((name, tuple(value) if isinstance(value, list) else value) for name, value in values)  # floats
    shapes = tuple(sorted((name, tuple(tensor.shape)) for name, tensor in embeddings.items()))
    return (*fields, ("task", task), ("cache", tuple(sorted(cache_record.items()))), ("shapes", shapes))


def default_batch_size(run, flags, videos: int, devices: int, per_host: int | None, memory: int | None) -> int:
    """--batch_size unset: runtime.mesh.default_batch for the group's `videos` (one with MagCache, which
    decides from each video's own data) on the mesh `flags` ask for (attention.plan.AttentionFlags), logged
    with its reason."""
    from tpu_video.runtime.mesh import default_batch

    from .meta import model_facts

    if run.cache.record()["kind"] == "magcache":
        size, why = 1, "--cache magcache runs one video per batch"
    else:
        size, why = default_batch(
            videos,
            devices,
            branches=run.family.guidance_branches(run.source, run.request),
            model=model_facts(run.family, run.source, run.dtype, flags.tp_mode, run.request),
            dp=flags.dp,
            sp=flags.sp,
            tp=flags.tp,
            devices_per_host=per_host,
            device_memory=memory,
        )
    log(f"batches of {size} ({why})")
    return size


class Generators:
    """The videos' CPU generators as one, for checkpoints: the state is every generator's, stacked."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators

    def get_state(self) -> torch.Tensor:
        return torch.stack([generator.get_state() for generator in self.generators])

    def set_state(self, state: torch.Tensor) -> None:
        for generator, own in zip(self.generators, state, strict=True):
            # A copy: torch 2.13's Generator.set_state crashes (segfault, or "Invalid mt19937 state") when
            # given a row of the stack, a view at a storage offset; a row at offset 0 happens to work.
            generator.set_state(own.clone())


def _join(tensors: list[torch.Tensor], branches: int) -> torch.Tensor:
    """Per-video batches of `branches` chunks each, as [every video's chunk 0, every video's chunk 1, ...]."""
    chunks = [tensor.chunk(branches) for tensor in tensors]
    return torch.cat([video[branch] for branch in range(branches) for video in chunks])


def _same(a, b) -> bool:
    """Equal inputs (tensors, or tuples of them such as rotary tables; None)."""
    from torch.utils import _pytree

    (left, left_spec), (right, right_spec) = _pytree.tree_flatten(a), _pytree.tree_flatten(b)
    if left_spec != right_spec:
        return False
    return all(
        torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x is y or x == y
        for x, y in zip(left, right, strict=True)
    )


def _batched_static(loops: list[DenoiseLoop]) -> tuple:
    """The transformer's inputs for the batch: those laid out along the batch joined, the others shared."""
    joined = []
    for position, (first, layout) in enumerate(loops[0].static_inputs):
        values = [loop.static_inputs[position][0] for loop in loops]
        if first is not None and layout and layout[0] == DP:
            joined.append((_join(values, first.shape[0]), layout))
            continue
        if all(_same(value, first) for value in values[1:]):
            joined.append((first, layout))  # shared: rotary tables, the guidance scale, t2v's zero images
        elif torch.is_tensor(first) and first.shape[0] == 1:
            joined.append((torch.cat(values), layout))  # per video (image conditioning), before the CFG doubling
        else:
            raise ValueError(f"transformer input {position} differs between videos and has no batch dimension")
    return tuple(joined)


def _video_rows(tensor: torch.Tensor, video: int, size: int) -> torch.Tensor:
    """One video's rows of a tensor laid out along the transformer's batch (`_join`'s order)."""
    return tensor.reshape(tensor.shape[0] // size, size, *tensor.shape[1:])[:, video]


def _prefixed(carry: dict, video: int) -> dict:
    return {f"video{video}.{key}": value for key, value in carry.items()}


def _own(carry: dict, video: int) -> dict:
    prefix = f"video{video}."
    return {key[len(prefix) :]: value for key, value in carry.items() if key.startswith(prefix)}


def batched_loop(loops: list[DenoiseLoop]) -> DenoiseLoop:
    """One loop for the videos of `loops` (one each, batch 1, same group): the batch's latents are the
    videos' in order; a checkpoint's carry holds each video's under `video<i>.`."""
    first = loops[0]
    sizes = [loop.latents.shape[0] for loop in loops]
    if set(sizes) != {1} or any(not torch.equal(loop.timesteps, first.timesteps) for loop in loops):
        raise ValueError("a batch joins single videos with the same schedule")

    def model_input(latents, t):
        return torch.cat([loop.model_input(latents[v : v + 1], t) for v, loop in enumerate(loops)])

    def step(i, t, noise_pred, latents, carry):
        pieces, carries = [], {}
        for v, loop in enumerate(loops):
            own, own_carry = loop.step(i, t, noise_pred[v : v + 1], latents[v : v + 1], _own(carry, v))
            pieces.append(own)
            carries.update(_prefixed(own_carry, v))
        return torch.cat(pieces), carries

    def on_start(start, carry):
        for v, loop in enumerate(loops):
            loop.on_start(start, _own(carry, v))

    carry = {key: value for v, loop in enumerate(loops) for key, value in _prefixed(loop.carry, v).items()}
    return DenoiseLoop(
        guided=first.guided,
        rules=first.rules,
        static_inputs=_batched_static(loops),
        timesteps=first.timesteps,
        latents=torch.cat([loop.latents for loop in loops]),
        generator=Generators([loop.generator for loop in loops]),
        step=step,
        model_input=model_input,
        on_start=on_start,
        carry=carry,
        expert=first.expert,
        expert_names=first.expert_names,
        timestep_input=first.timestep_input,
        cache_branches=first.cache_branches,
        between_plan=first.between_plan,
        label=first.label,
    )


class BatchGuard:
    """The DenoiseGuards of a batch's videos (each its folder's) as one for the loop: NaN checks on the
    batch, and each checkpoint split into the videos' own (what a single run of that folder saves, so a
    folder stopped in a batch resumes alone or in a batch). Videos past `guards` are padding: copies of
    the last video, restored from its state and never saved."""

    def __init__(self, guards: list, size: int, stop) -> None:
        self.guards = guards
        for guard in guards:
            guard.batch_size = size  # saved with each checkpoint: a resumed batch is the batch it was
        self.size = size
        self.stop = stop  # its `stop_requested` is set by SIGTERM (guard.sigterm_sets_stop)
        self.restored = self._restored()

    def _restored(self):
        restored = [guard.restored for guard in self.guards]
        if all(state is None for state in restored):
            return None
        steps = {None if state is None else state[0] for state in restored}
        if len(steps) > 1:
            raise ValueError("a batch joins videos stopped after the same step")
        states = [state[1] for state in restored] + [restored[-1][1]] * (self.size - len(restored))
        joined = {
            "latents": torch.cat([state["latents"] for state in states]),
            "generator_state": torch.stack([state["generator_state"] for state in states]),
        }
        for key in filter(is_batched_state, states[0]):  # the step cache's residuals
            joined[key] = _join([state[key] for state in states], states[0][key].shape[0])
        for v, state in enumerate(states):
            rest = {key: value for key, value in state.items() if key not in joined}
            joined.update(_prefixed(rest, v))
        return steps.pop(), joined

    def after_step(self, index: int, total: int, tensors: dict, more=dict, where: str = "") -> None:
        from tpu_video.cli import Stopped

        batch_more = functools.cache(more)  # fetched once, only if some video's checkpoint is written

        def own_more(video):
            return {
                key: _video_rows(value, video, self.size) if is_batched_state(key) else value
                for key, value in batch_more().items()
            }

        stopped = []
        for v, guard in enumerate(self.guards):
            guard.stop_requested = self.stop.stop_requested
            own = {
                "latents": tensors["latents"][v : v + 1],
                "generator_state": tensors["generator_state"][v],
                **_own(tensors, v),
            }
            try:
                guard.after_step(index, total, own, more=functools.partial(own_more, v), where=where)
            except Stopped as stop:
                stopped.append(stop)
        if stopped:
            raise stopped[0]

    def finished(self) -> None:
        for guard in self.guards:
            guard.finished()


def denoise_group(
    family, source, batches: list[list], size: int, dtype, runtime, options: DenoiseOptions, stop, write
) -> None:
    """Denoise one group's batches (lists of stages.stage2_inputs.ValidatedRun, at most `size` each) with
    the transformers loaded, placed and compiled once: every batch is padded to `size` with copies of its
    last video, so all share one program (and a resumed batch is the batch it was).
    `write(video, latents, info, timer, timing, record, step_cache)` is called for each video as its batch
    finishes (`timing`: the batch's timing table, shared by its videos; `step_cache`: the step cache's record
    or None); `stop.stop_requested` (set by SIGTERM: guard.sigterm_sets_stop) stops after a step."""
    timer = Timer()  # one per batch (the first also times the load), its table shared by the batch's videos
    transformers = load_transformers(family, source, dtype, options, timer)
    placed = None
    for number, videos in enumerate(batches, 1):
        members = videos + [videos[-1]] * (size - len(videos))
        built = [
            family.denoise_loop(
                source, video.request, video.embeddings, dtype, transformers, runtime, options.tp_mode, planning=False
            )
            for video in members
        ]
        loops = [started(loop, video.start_latents) for (loop, _), video in zip(built, members, strict=True)]
        timer = timer if number == 1 else Timer()
        loops, finished = segments.resumed(loops, [video.guard for video in members], timer)
        loop = batched_loop(loops)
        reused = placed is not None
        if placed is None:
            with timer.phase("place"):
                placed = place_denoisers(loop, runtime, options)
        guard = BatchGuard([video.guard for video in videos], size, stop)
        batch_options = dataclasses.replace(options, guard=guard, warmup_steps=0 if reused else options.warmup_steps)
        run = functools.partial(run_denoise_loop, runtime=runtime, timer=timer, placed=placed)
        latents, cache = segments.run_in_order(loops, finished, batched_loop, run, batch_options, timer)
        record = {"number": number, "of": len(batches), "size": size, "padding": size - len(videos)}
        record["folders"] = [video.output_dir.name for video in videos]  # configs hold no host paths
        record["program"] = "reused" if reused else "compiled"
        timing = timer.finish()
        record["videos_per_hour"] = round(3600 * len(videos) / timing["total"], 1)  # this batch's rate
        step_cache = {**cache.record(), **timer.median_steps()} if cache is not None else None
        log(f"batch {number} of {len(batches)}: {len(videos)} video(s), {record['videos_per_hour']} videos per hour")
        for position, video in enumerate(videos):
            own, info = built[position][1](latents[position : position + 1])
            info = {**info, **scanned_blocks.record(loop, options.scan_blocks)}
            write(video, own, info, timer, timing, record, step_cache)
        guard.finished()
