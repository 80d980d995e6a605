"""HunyuanVideo-1.5's stage 3: the VAE made jit-safe (its attention's frame-causal mask without the per-token
loop) and the decoder stage 3 runs, with the pipeline's post-processor."""

from __future__ import annotations

import torch

from .common import recorded_scaling_factor


def frame_causal_mask(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None) -> torch.Tensor:
    """AutoencoderKLHunyuanVideo15's `prepare_causal_attention_mask` without the per-token loop: token i
    sees every token of its own and earlier frames (0), nothing later (-inf)."""
    frame = torch.arange(n_frame * n_hw, device=device) // n_hw
    mask = torch.where(frame[None, :] <= frame[:, None], 0.0, float("-inf")).to(dtype)
    if batch_size is not None:
        mask = mask.unsqueeze(0).expand(batch_size, -1, -1)
    return mask


def make_vae_jit_safe(vae: torch.nn.Module) -> torch.nn.Module:
    """The one place HunyuanVideo-1.5's VAE is adapted for jit: every attention block gets `frame_causal_mask`."""
    for module in vae.modules():
        if hasattr(module, "prepare_causal_attention_mask"):
            module.prepare_causal_attention_mask = frame_causal_mask
    return vae


class Decoder(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, normalization: dict) -> None:
        super().__init__()
        self.vae = make_vae_jit_safe(vae)
        self.scaling_factor = recorded_scaling_factor(normalization)

    def forward(self, latents):
        # The pipeline's own expression: the scaling factor undone before decoding.
        latents = latents.to(self.vae.dtype) / self.scaling_factor
        return self.vae.decode(latents, return_dict=False)[0]


def video_processor(source):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return HunyuanVideo15ImageProcessor(vae_scale_factor=source.load_config("vae")["spatial_compression_ratio"])
