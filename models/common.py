"""Stage bodies shared by every family."""

from __future__ import annotations

import contextlib

import torch

from utils import log, step_progress


def text_encoder_on(runtime, encoder: torch.nn.Module, hidden_states: bool = False) -> torch.nn.Module:
    """`encoder` ready for a diffusers pipeline's `encode_prompt` on `runtime`: the module itself on a
    torch device, or a `DeviceTextEncoder` with its weights sharded over a JAX mesh by the encoder's
    rule table (sharding.text_encoder_rules)."""
    if runtime.name == "torch":
        return runtime.compile(encoder)
    return DeviceTextEncoder(encoder, runtime, hidden_states)


class _EncoderOutputs(torch.nn.Module):
    """The jitted side: plain tensors out (jax.jit returns no ModelOutput or cache objects)."""

    def __init__(self, encoder: torch.nn.Module, hidden_states: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.hidden_states = hidden_states

    def forward(self, input_ids, attention_mask):
        if not self.hidden_states:
            return (self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)
        output = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return (output.last_hidden_state, *output.hidden_states)


@contextlib.contextmanager
def _quiet_attribute_scan():
    """torchax 0.0.13's JittableModule finds a module's tensors by reading every attribute of every
    submodule (`dir` + `getattr`). On a transformers model that evaluates two properties that only
    warn: `is_gradient_checkpointing` (a FutureWarning) and `loss_function` (a "loss_type=None" log
    line). Neither matters for inference; silence exactly those two while torchax scans."""
    import warnings

    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        transformers_logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers_logging.set_verbosity(verbosity)


class DeviceTextEncoder(torch.nn.Module):
    """A text encoder run jitted on a JAX mesh but called as diffusers pipelines call one on the host:
    CPU token ids in, a CPU `BaseModelOutput` out (`[0]` and, if built with `hidden_states`, every
    layer's `.hidden_states`). One compile per input shape; the pipelines pad to a fixed length."""

    def __init__(self, encoder: torch.nn.Module, runtime, hidden_states: bool) -> None:
        import sharding

        super().__init__()
        self.config = encoder.config
        self.encoder_dtype = encoder.dtype
        self.runtime = runtime
        rules = sharding.text_encoder_rules(encoder.config, runtime.mesh.shape["tp"])
        with _quiet_attribute_scan():
            self.jitted = runtime.compile(_EncoderOutputs(encoder, hidden_states), rules.nested("encoder."))

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder_dtype

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None):
        from transformers.modeling_outputs import BaseModelOutput

        outputs = self.jitted(*self.runtime.to_device((input_ids, attention_mask)))
        last, *layers = (self.runtime.to_host(output) for output in outputs)
        if output_hidden_states and not layers:
            raise ValueError("this DeviceTextEncoder was built without hidden_states")
        return BaseModelOutput(last_hidden_state=last, hidden_states=tuple(layers) or None)


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
