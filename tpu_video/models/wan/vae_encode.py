"""Wan's VAE encode on JAX devices one chunk of frames per call, the encoder's causal-conv cache carried between
calls as explicit inputs and outputs, as vae.py decodes: for the pipelines' encodes of whole videos (stage 1's,
`device_encoder`) and for Animate's work between segments, a decode and an encode on one VAE placed once
(`coder_programs`, `coder_plan` for `--plan`).

The stock `_encode` runs its encoder the first frame, then `ENCODE_FRAMES` at a time, the cache empty on the first
call, then holding one frame per slot, then two (the downsamplers' one): three programs whatever the length
(`EncoderPrograms`), where jitting the stock encode unrolls every chunk into one program.
"""

from __future__ import annotations

import torch

from tpu_video.engine.decode import run_in_chunks
from tpu_video.engine.encoders import StandIn, vae_output

from .vae import (
    PROGRAMS,
    FramePrograms,
    cache_layout,
    decoder_layout,
    frame_decode,
    meta_frame,
    plan_inputs,
    program_calls,
    program_of,
)

ENCODE_FRAMES = 4  # pixel frames per encoder call after the first (AutoencoderKLWan._encode)
ENCODER_PROGRAMS = tuple(f"encode_{name}" for name in PROGRAMS)


class EncoderMethods:
    """The stock encode of one chunk of frames as three methods (`ENCODER_PROGRAMS`), one per cache layout
    (`encoder_kinds`), on the module's `vae`: the Wan 2.2 VAE's patchify (per pixel, so per chunk as over the
    video), the encoder with the cache given as tensors, quant_conv (one frame wide, likewise); returns (the
    chunk's posterior parameters, the cache's tensors), all pinned to `layout`."""

    def _chunk(self, program: int, pixels, cache):
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        vae, tensors = self.vae, iter(cache)
        pixels = self.constrain(pixels, self.layout, uneven=True)
        slots = [None if kind is None else next(tensors) for kind in self.encoder_kinds[program]]
        if vae.config.patch_size is not None:
            pixels = patchify(pixels, patch_size=vae.config.patch_size)
        out = vae.quant_conv(vae.encoder(pixels, feat_cache=slots, feat_idx=[0]))
        return tuple(self.constrain(tensor, self.layout) for tensor in (out, *[s for s in slots if s is not None]))

    def encode_first(self, pixels, *cache):
        return self._chunk(0, pixels, cache)

    def encode_second(self, pixels, *cache):
        return self._chunk(1, pixels, cache)

    def encode_steady(self, pixels, *cache):
        return self._chunk(2, pixels, cache)


class EncoderPrograms(EncoderMethods, torch.nn.Module):
    """The encoder's three programs alone (stage 1's encodes)."""

    def __init__(self, vae: torch.nn.Module, encoder_kinds: list[tuple], constrain, layout) -> None:
        super().__init__()
        self.vae = vae
        self.encoder_kinds = encoder_kinds
        self.constrain = constrain
        self.layout = layout


class CoderPrograms(EncoderMethods, FramePrograms):
    """FramePrograms and the encoder's three programs on one VAE, placed once for both (Animate between
    segments)."""

    def __init__(self, decoder: torch.nn.Module, kinds: list[tuple], encoder_kinds: list[tuple], constrain, layout):
        super().__init__(decoder, kinds, constrain, layout)
        self.encoder_kinds = encoder_kinds

    @property
    def vae(self) -> torch.nn.Module:
        return self.decoder.vae


def encode_spans(frames: int) -> list[tuple[int, int]]:
    """The stock encode's chunks of a video of `frames` frames: the first, then `ENCODE_FRAMES` at a time (frames
    after the last whole chunk are left out, as the stock encode leaves them)."""
    whole = (frames - 1) // ENCODE_FRAMES
    return [(0, 1)] + [(1 + ENCODE_FRAMES * i, 1 + ENCODE_FRAMES * (i + 1)) for i in range(whole)]


def encoder_layout(vae, pixels_shape) -> list[tuple[tuple, list[torch.Tensor]]]:
    """`cache_layout` of the encoder's first three calls on videos of `pixels_shape` (any frame count; meta `vae`)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    chunks = [meta_chunk(pixels_shape, frames, vae.dtype) for frames in (1, ENCODE_FRAMES, ENCODE_FRAMES)]
    if vae.config.patch_size is not None:
        chunks = [patchify(chunk, patch_size=vae.config.patch_size) for chunk in chunks]

    def call(chunk, cache, index):
        vae.encoder(chunk, feat_cache=cache, feat_idx=[0])

    return cache_layout(vae._cached_conv_counts["encoder"], call, chunks)


def meta_chunk(pixels_shape, frames: int, dtype: torch.dtype) -> torch.Tensor:
    """`frames` frames of a video of `pixels_shape` on the meta device (shapes only)."""
    return torch.zeros(*pixels_shape[:2], frames, *pixels_shape[3:], dtype=dtype, device="meta")


def _encode(programs, runtime, layout):
    """The encode of a video of any frame count through placed encoder programs, one chunk per call."""

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        spans = encode_spans(pixels.shape[2])
        names = [f"encode_{program_of(index)}" for index in range(len(spans))]
        return run_in_chunks(programs, names, spans, pixels, runtime, layout)

    return encode


def coder_programs(source, decoder: torch.nn.Module, latents_shape, pixels_shape, runtime, layout):
    """The decode of `latents_shape` latents and the encode of videos of `pixels_shape`'s size on `runtime`, one VAE
    placed (replicated) for both: (decode, encode), functions of CPU tensors giving the video in [-1, 1] and the
    posterior's parameters on the host, as the stock `decode` and `_encode` return them."""
    from tpu_video.engine.meta import meta_module

    meta_vae = meta_module(source, "vae", decoder.latents_mean.dtype)
    kinds = [kinds for kinds, _ in decoder_layout(meta_vae, meta_frame(decoder, latents_shape))]
    encoder_kinds = [kinds for kinds, _ in encoder_layout(meta_vae, pixels_shape)]
    module = CoderPrograms(decoder, kinds, encoder_kinds, runtime.constrain, layout)
    programs = runtime.compile(module, methods=PROGRAMS + ENCODER_PROGRAMS)
    return frame_decode(programs, latents_shape[2], runtime, layout), _encode(programs, runtime, layout)


def device_encoder(source, vae: torch.nn.Module, runtime, height: int, width: int) -> ChunkedEncoder:
    """A stand-in for `vae` in the pipelines' encodes of videos of `height` x `width` (one video, any frame count):
    EncoderPrograms placed on `runtime`, the frames split over every device (a `--backend torch` runtime runs
    them eagerly)."""
    from tpu_video.engine.decode import split_over_mesh
    from tpu_video.engine.meta import meta_module

    pixels_shape = (1, 3, 1, height, width)
    layout = split_over_mesh(pixels_shape, getattr(runtime, "mesh", None))
    kinds = [kinds for kinds, _ in encoder_layout(meta_module(source, "vae", vae.dtype), pixels_shape)]
    programs = runtime.compile(EncoderPrograms(vae, kinds, runtime.constrain, layout), methods=ENCODER_PROGRAMS)
    return ChunkedEncoder(vae, _encode(programs, runtime, layout))


def coder_plan(decoder: torch.nn.Module, latents_shape, pixels_shape, runtime, layout) -> tuple:
    """For --plan: CoderPrograms on a meta VAE (`decoder.vae`), the (tensor, layout) inputs of each of its six
    programs (meta tensors), and how often a segment calls each."""
    vae = decoder.vae
    frames, inputs, calls = plan_inputs(decoder, vae, latents_shape, runtime, layout)  # as stage 3 plans them
    encode = encoder_layout(vae, pixels_shape)
    module = CoderPrograms(decoder, frames.kinds, [kinds for kinds, _ in encode], runtime.constrain, layout)
    for index, (name, (_, cache)) in enumerate(zip(ENCODER_PROGRAMS, encode, strict=True)):
        chunk = meta_chunk(pixels_shape, 1 if index == 0 else ENCODE_FRAMES, vae.dtype)
        inputs[name] = [(chunk, layout), *((tensor, layout) for tensor in cache)]
    calls.update(zip(ENCODER_PROGRAMS, program_calls(len(encode_spans(pixels_shape[2]))), strict=True))
    return module, inputs, calls


class ChunkedEncoder(StandIn):
    """A stand-in for the Wan VAE where a pipeline only encodes with it (`vae.encode(x).latent_dist`, `vae.config`,
    `vae.dtype`), the encode done by `encode` (`device_encoder`, `coder_programs`)."""

    def __init__(self, vae: torch.nn.Module, encode) -> None:
        super().__init__(vae)
        self._encode = encode

    def encode(self, pixels, return_dict: bool = True):
        return vae_output(self._encode(pixels), return_dict)
