"""A video denoised as several loops in order (`DenoiseLoop.then`: Wan Animate's segments, each conditioned on
the decoded end of the one before). The next loop is built as each finishes, on the programs placed for the
first; every checkpoint of a later loop also holds the finished loops' latents, so a resumed run rebuilds the
loop its checkpoint was saved in (`resumed`: each `then` replays only the work between loops, no denoising)
and goes on from that checkpoint's step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

DenoiseLoop = Any  # a denoise.DenoiseLoop (not imported: denoise.py imports this module)

FINISHED = "segments.finished."  # carry keys: the latents of each loop before this one


def _restored(guard) -> dict:
    """The tensors of the guard's restored checkpoint (none without one)."""
    return guard.restored[1] if guard is not None and guard.restored is not None else {}


def position(guard) -> int:
    """How many of a video's loops its restored checkpoint (if any) had finished: videos resume together only at
    the same loop and step."""
    return sum(key.startswith(FINISHED) for key in _restored(guard))


def resumed(loops: list[DenoiseLoop], guards: list, timer) -> tuple[list[DenoiseLoop], list[list[torch.Tensor]]]:
    """Each video's loop that its restored checkpoint (of its guard, if any) was saved in, and the latents of
    the loops it finished before; the work between loops it replays is timed as `between_loops`."""
    rebuilt, finished = [], []
    for loop, guard in zip(loops, guards, strict=True):
        done: list[torch.Tensor] = []
        state = _restored(guard)
        while f"{FINISHED}{len(done)}" in state:
            done.append(state[f"{FINISHED}{len(done)}"])
            with timer.phase("between_loops"):
                loop = loop.then(done[-1])
        rebuilt.append(loop)
        finished.append(done)
    return rebuilt, finished


def keeping(loop: DenoiseLoop, finished: list[torch.Tensor]) -> DenoiseLoop:
    """`loop` whose carry, saved with every checkpoint, also holds the finished loops' latents."""
    if not finished:
        return loop
    kept = {f"{FINISHED}{index}": latents for index, latents in enumerate(finished)}

    def step(i, t, noise_pred, latents, carry):
        latents, carry = loop.step(i, t, noise_pred, latents, carry)
        return latents, {**carry, **kept}

    return dataclasses.replace(loop, step=step, carry={**loop.carry, **kept})


def run_in_order(
    loops: list[DenoiseLoop],
    finished: list[list[torch.Tensor]],
    join: Callable[[list[DenoiseLoop]], DenoiseLoop],
    run: Callable[..., tuple[torch.Tensor, Any]],
    options,
    timer,
) -> tuple[torch.Tensor, Any]:
    """Run the videos' loops, `join`ed into one, then their next loops while they have them. `run(loop,
    options=, restore=)` runs one (denoise.run_denoise_loop on the placed programs): the first restores a
    checkpoint and warms up as `options` say; the later ones start at their first step, warm already. The work
    between loops (`then`: Wan Animate's decode and encode) is timed as `between_loops`. Returns the last loops'
    final latents and `run`'s second value (the step cache)."""
    first = True
    while True:
        joined = join([keeping(loop, done) for loop, done in zip(loops, finished, strict=True)])
        latents, other = run(joined, options=options, restore=first)
        if {loop.then is None for loop in loops} != {loops[0].then is None}:
            raise ValueError("a batch joins videos at the same loop of the same count")
        if loops[0].then is None:
            return latents, other
        first, options = False, dataclasses.replace(options, warmup_steps=0)
        for video, done in enumerate(finished):
            done.append(latents[video : video + 1])
        with timer.phase("between_loops"):
            loops = [loop.then(latents[video : video + 1]) for video, loop in enumerate(loops)]
