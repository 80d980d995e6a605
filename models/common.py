"""Stage bodies shared by every family."""

from __future__ import annotations

import torch

from utils import log, step_progress

# Stage 3: (B, C, F, H, W) latents split along width over the mesh's `sp` axis (a plain tuple: no JAX).
LATENTS_WIDTH_SPLIT = (None, None, None, None, "sp")


def decode_frames(source, decoder_cls, processor, latents, dtype, runtime, timer, tiling: bool = False):
    """Load the VAE, decode on `runtime` with the family's `decoder_cls` (latents to pixels in [-1, 1],
    one graph) and post-process with the pipeline's `processor`: frames (F, H, W, 3) float32 in [0, 1]."""
    with timer.phase("load"):
        vae = source.load("vae", dtype=dtype).eval()
    if tiling:
        vae.enable_tiling()
    with timer.phase("place"):
        decoder = runtime.compile(decoder_cls(vae))  # weights replicated
        device_latents = runtime.to_device(latents.to(dtype), LATENTS_WIDTH_SPLIT)
    with timer.phase("decode"), torch.no_grad():
        video = runtime.to_host(decoder(device_latents))
    frames = processor.postprocess_video(video=video.float(), output_type="np")
    return torch.from_numpy(frames[0])


def denoising_loop(
    timesteps, latents, carry, predict_noise, scheduler_step, generator, runtime, timer, warmup_steps=0, guard=None
):
    """Stage 2's loop for every family: warmup, resume, then the timed steps with per-step checks and
    checkpoints. `predict_noise(latents, t)` is the one denoiser call (warmup runs exactly it);
    `scheduler_step(i, t, noise_pred, latents, carry)` returns (latents, carry), where `carry` holds the
    scheduler's extra tensors (e.g. DPM's previous prediction) that a checkpoint must keep."""
    if warmup_steps:
        with timer.phase("compile"):  # the first call traces and compiles; results are discarded
            for _ in range(warmup_steps):
                predict_noise(latents, timesteps[0])

    start = 0
    if guard is not None and guard.restored is not None:  # --resume: the loop state after step `start`
        start, state = guard.restored
        state = dict(state)
        latents = state.pop("latents")
        generator.set_state(state.pop("generator_state"))
        carry = {**carry, **state}
        log(f"resuming after step {start} of {len(timesteps)}")

    steps = list(enumerate(timesteps))[start:]
    for _, (i, t) in step_progress(steps, timer, trace=runtime.profile_trace()):
        noise_pred = predict_noise(latents, t)
        latents, carry = scheduler_step(i, t, noise_pred, latents, carry)
        if guard is not None:
            state = {"latents": latents, "generator_state": generator.get_state(), **carry}
            guard.after_step(i, len(timesteps), state)
    return latents
