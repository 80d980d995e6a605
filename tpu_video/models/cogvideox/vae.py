"""CogVideoX's stage-3 decode on JAX devices in the stock decode's own frame batches, the decoder's conv cache
carried between calls as explicit inputs and outputs.

`AutoencoderKLCogVideoX._decode` runs its decoder on batches of `num_latent_frames_batch_size` (2) latent
frames, the remainder joining the first batch, passing `conv_cache` (a nested dict of the causal convs' last
frames) from batch to batch; its GroupNorms see one batch at a time. So two programs reproduce it exactly:
"first" (2 + remainder frames, no cache) and "steady" (2 frames, the cache in and out). The cache's nesting is
the same for every video; it comes from running the decoder on the meta device and is flattened to a list of
tensors for the programs. Chunks are the stock batches and nothing else (`CHUNK_FRAMES`).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree

from tpu_video.engine.decode import frame_batches, run_in_chunks

CHUNK_FRAMES = (2,)  # latent frames per call: the stock decode's frame batch
PROGRAMS = ("first", "steady")


def meta_cache(vae, latents_shape, dtype) -> tuple[list[torch.Tensor], _pytree.TreeSpec]:
    """The decoder's conv cache after the first batch, flattened (meta device: shapes only), and its nesting."""
    first = frame_batches(latents_shape[2], vae.num_latent_frames_batch_size)[0]
    sample = torch.zeros(*latents_shape[:2], first[1] - first[0], *latents_shape[3:], dtype=dtype, device="meta")
    with torch.no_grad():
        _, cache = vae.decoder(vae.post_quant_conv(sample) if vae.post_quant_conv is not None else sample)
    return _pytree.tree_flatten(cache)


class BatchPrograms(torch.nn.Module):
    """The stock decode of one frame batch as two methods: the pipeline's scaling undone (`decoder`, a
    models.cogvideox.Decoder), post_quant_conv, the decoder with the cache given as a flat list of tensors;
    returns (pixels, the new cache's tensors), pinned to `layout` (split along width)."""

    def __init__(self, decoder: torch.nn.Module, spec: _pytree.TreeSpec, constrain, layout) -> None:
        super().__init__()
        self.decoder = decoder
        self.spec = spec
        self.constrain = constrain
        self.layout = layout

    def _batch(self, latents, cache):
        vae = self.decoder.vae
        latents = self.constrain(latents, self.layout, uneven=True)  # engine.decode.latents_split
        latents = 1 / self.decoder.scaling_factor * latents  # CogVideoXPipeline.decode_latents' expression
        if vae.post_quant_conv is not None:
            latents = vae.post_quant_conv(latents)
        out, new_cache = vae.decoder(latents, conv_cache=cache)
        outputs = (out, *_pytree.tree_flatten(new_cache)[0])
        return tuple(self.constrain(tensor, self.layout) for tensor in outputs)

    def first(self, latents):
        return self._batch(latents, None)

    def steady(self, latents, *cache):
        return self._batch(latents, _pytree.tree_unflatten(list(cache), self.spec))


def frame_programs(source, decoder: torch.nn.Module, latents_shape, runtime, layout, chunk_frames: int = 2):
    """tpu_video/models/family.py's `frame_programs` for CogVideoX: the two programs placed; a function of the latents
    giving the video on the host."""
    from tpu_video.engine.meta import meta_module

    _, spec = meta_cache(meta_module(source, "vae", decoder.vae.dtype), latents_shape, decoder.vae.dtype)
    programs = runtime.compile(BatchPrograms(decoder, spec, runtime.constrain, layout), methods=PROGRAMS)
    spans = frame_batches(latents_shape[2], decoder.vae.num_latent_frames_batch_size)
    names = ["first"] + ["steady"] * (len(spans) - 1)
    return lambda latents: run_in_chunks(programs, names, spans, latents, runtime, layout)


def frame_plan(source, decoder: torch.nn.Module, latents_shape, runtime, layout, chunk_frames: int = 2):
    """tpu_video/models/family.py's `frame_plan` for CogVideoX (a plan's VAE is on the meta device already)."""
    vae = decoder.vae
    cache, spec = meta_cache(vae, latents_shape, vae.dtype)
    (start, end), *rest = frame_batches(latents_shape[2], vae.num_latent_frames_batch_size)
    frames = [torch.zeros(*latents_shape[:2], count, *latents_shape[3:], dtype=vae.dtype) for count in (end - start, 2)]
    inputs = {"first": [(frames[0], layout)], "steady": [(frames[1], layout), *((t, layout) for t in cache)]}
    calls = {"first": 1, "steady": len(rest)}
    return BatchPrograms(decoder, spec, runtime.constrain, layout), inputs, calls
