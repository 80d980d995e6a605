"""Stage bodies shared by every family."""

from __future__ import annotations

import torch

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
