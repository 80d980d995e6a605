"""Wan's stage-3 decode on JAX devices one latent frame per call, the decoder's causal-conv cache carried
between calls as explicit inputs and outputs (vae_encode.py: the encode the same way).

The stock `AutoencoderKLWan._decode` already runs its decoder one latent frame at a time (`first_chunk` on
the first), keeping `feat_cache`: for each causal convolution the last frames it saw, and for each temporal
upsampler a "Rep" marker after the first frame. Which slots hold tensors, markers or nothing is the same for
every video: the first call starts empty, the second sees the markers, every later call only tensors. So
three programs ("first", "second", "steady") compile once each whatever the frame count, where jitting the
stock decode unrolls its frame loop into one program as large as the video. The slot layout comes from
running the decoder on the meta device (shapes only). One latent frame per call is the stock unit: larger
chunks would take the upsamplers' other branch, so they are not offered (`CHUNK_FRAMES`).
"""

from __future__ import annotations

import torch

from tpu_video.engine.decode import run_in_chunks

CHUNK_FRAMES = (1,)  # latent frames per call that equal the stock decode
PROGRAMS = ("first", "second", "steady")
REP = "Rep"  # the stock decoder's marker for "upsampler saw the first frame"


def _slot_kinds(cache: list) -> tuple[str | None, ...]:
    return tuple(None if slot is None else REP if isinstance(slot, str) else "tensor" for slot in cache)


def cache_layout(slots: int, call, chunks: list[torch.Tensor]) -> list[tuple[tuple, list[torch.Tensor]]]:
    """Per program: the cache's slot kinds on entry and the tensors it receives, from `call(chunk, cache,
    index)` on each of `chunks` in turn (on the meta device for shapes only) with a cache of `slots` slots."""
    cache: list = [None] * slots
    layout = []
    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            layout.append((_slot_kinds(cache), [slot for slot in cache if torch.is_tensor(slot)]))
            call(chunk, cache, index)
    return layout


def decoder_layout(vae, frame: torch.Tensor) -> list[tuple[tuple, list[torch.Tensor]]]:
    """`cache_layout` of the decoder's three calls on `frame` (one normalised latent frame)."""

    def call(frame, cache, index):
        vae.decoder(vae.post_quant_conv(frame), feat_cache=cache, feat_idx=[0], first_chunk=index == 0)

    return cache_layout(vae._cached_conv_counts["decoder"], call, [frame] * len(PROGRAMS))


class FramePrograms(torch.nn.Module):
    """The stock decode of one latent frame as three methods, one per cache layout: the pipeline's
    de-normalisation (`decoder`, a models.wan.Decoder), post_quant_conv, the decoder with the cache given
    as tensors, the Wan 2.2 VAE's unpatchify and the clamp; returns (pixels, the cache's tensors), all
    pinned to `layout` (split along width: left free, the partitioner returned some of the cache whole)."""

    def __init__(self, decoder: torch.nn.Module, kinds: list[tuple], constrain, layout) -> None:
        super().__init__()
        self.decoder = decoder
        self.kinds = kinds
        self.constrain = constrain
        self.layout = layout

    def _frame(self, program: int, latents, cache):
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae, tensors = self.decoder.vae, iter(cache)
        latents = self.constrain(latents, self.layout, uneven=True)  # engine.decode.latents_split
        slots = [None if kind is None else REP if kind == REP else next(tensors) for kind in self.kinds[program]]
        latents = latents.to(self.decoder.latents_mean.dtype) / self.decoder.latents_std + self.decoder.latents_mean
        out = vae.decoder(vae.post_quant_conv(latents), feat_cache=slots, feat_idx=[0], first_chunk=program == 0)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        outputs = (torch.clamp(out, min=-1.0, max=1.0), *[slot for slot in slots if torch.is_tensor(slot)])
        return tuple(self.constrain(tensor, self.layout) for tensor in outputs)

    def first(self, latents, *cache):
        return self._frame(0, latents, cache)

    def second(self, latents, *cache):
        return self._frame(1, latents, cache)

    def steady(self, latents, *cache):
        return self._frame(2, latents, cache)


def program_of(index: int) -> str:
    return PROGRAMS[min(index, len(PROGRAMS) - 1)]


def meta_frame(decoder: torch.nn.Module, shape) -> torch.Tensor:
    """A normalised latent frame of the VAE's dtype on the meta device, for `decoder_layout`."""
    return torch.zeros(shape[0], shape[1], 1, *shape[3:], dtype=decoder.latents_mean.dtype, device="meta")


def place(decoder: torch.nn.Module, meta_vae, latents_shape, runtime, layout):
    """The three frame programs with the VAE's weights placed (replicated) on `runtime`."""
    kinds = [kinds for kinds, _ in decoder_layout(meta_vae, meta_frame(decoder, latents_shape))]
    return runtime.compile(FramePrograms(decoder, kinds, runtime.constrain, layout), methods=PROGRAMS)


def plan_inputs(decoder: torch.nn.Module, meta_vae, latents_shape, runtime, layout) -> tuple:
    """For --plan: the programs' module, per program its inputs as (tensor, layout) pairs (a latent frame and
    the cache it receives, all split along width as `layout` says; shapes on the meta device), and how often
    a video of `latents_shape` calls each."""
    frame = meta_frame(decoder, latents_shape)
    layouts = decoder_layout(meta_vae, frame)
    module = FramePrograms(decoder, [kinds for kinds, _ in layouts], runtime.constrain, layout)
    inputs = {
        name: [(frame, layout), *((t, layout) for t in cache)]
        for name, (_, cache) in zip(PROGRAMS, layouts, strict=True)
    }
    return module, inputs, dict(zip(PROGRAMS, program_calls(latents_shape[2]), strict=True))


def program_calls(chunks: int) -> tuple[int, int, int]:
    """How often a video of `chunks` chunks calls the first, second and steady programs."""
    return 1, min(chunks - 1, 1), max(chunks - 2, 0)


def frame_programs(source, decoder: torch.nn.Module, latents_shape, runtime, layout, chunk_frames: int = 1):
    """tpu_video/models/family.py's `frame_programs` for Wan: the three programs placed; a function of the latents
    giving the video on the host."""
    from tpu_video.engine.meta import meta_module

    meta_vae = meta_module(source, "vae", decoder.latents_mean.dtype)
    programs = place(decoder, meta_vae, latents_shape, runtime, layout)
    return frame_decode(programs, latents_shape[2], runtime, layout)


def frame_decode(programs, frames: int, runtime, layout):
    """The decode of `frames` latent frames through placed frame programs, one per call."""
    names, spans = [program_of(index) for index in range(frames)], [(index, index + 1) for index in range(frames)]
    return lambda latents: run_in_chunks(programs, names, spans, latents, runtime, layout)


def frame_plan(source, decoder: torch.nn.Module, latents_shape, runtime, layout, chunk_frames: int = 1):
    """tpu_video/models/family.py's `frame_plan` for Wan (a plan's VAE is on the meta device already)."""
    return plan_inputs(decoder, decoder.vae, latents_shape, runtime, layout)
