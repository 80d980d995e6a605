"""Wan 2.2 TI2V-5B (`expand_timesteps` in its model_index.json): one transformer that takes a timestep per
video token, the 48-channel Wan 2.2 VAE (16x spatial compression), and both tasks in one model.

Text-to-video runs WanPipeline's loop: every token gets the step's timestep. With `--image`, stage 1 encodes
the image as WanImageToVideoPipeline's expand_timesteps branch does (`image_latents`: the normalised VAE
latents of the image alone), and each step the first latent frame is replaced by them and its tokens get
timestep 0 (`first_frame_mask`); the final latents get the same replacement. The host does the blend (it
is what the pipeline computes before casting) and passes the per-token timesteps; the transformer call is
the stock one.
"""

from __future__ import annotations

from typing import Any

import torch

IMAGE_LATENTS = "image_latents"


def expand_timesteps(source) -> bool:
    return bool(source.index.get("expand_timesteps"))


def encode_image(source, request, image, vae) -> dict[str, torch.Tensor]:
    """The image's normalised VAE latents (1, z_dim, 1, H/16, W/16), by the image-to-video pipeline's own
    preprocessing and `prepare_latents` (`vae`: the float32 VAE, on the stage's runtime; the posterior's mode;
    its noise is drawn in stage 2)."""
    from diffusers import WanImageToVideoPipeline

    none = dict.fromkeys(("tokenizer", "text_encoder", "scheduler", "image_processor", "image_encoder", "transformer"))
    pipe = WanImageToVideoPipeline(vae=vae, **none, expand_timesteps=True)
    height, width, frames = request.height, request.width, request.num_frames
    pixels = pipe.video_processor.preprocess(image, height=height, width=width).float()
    config = vae.config
    latent_frames = (frames - 1) // config.scale_factor_temporal + 1
    spatial = config.scale_factor_spatial
    noise = torch.zeros(1, config.z_dim, latent_frames, height // spatial, width // spatial)
    _, latents, _ = pipe.prepare_latents(
        pixels, 1, config.z_dim, height, width, frames, torch.float32, "cpu", None, noise
    )
    return {IMAGE_LATENTS: latents}


def loop_parts(source, embeds: dict[str, torch.Tensor], latents: torch.Tensor) -> dict[str, Any]:
    """What the loop changes for TI2V: the per-token timestep input (the pipeline's
    `first_frame_mask[0][0][:, ::2, ::2] * t`, flattened), the image's latents blended into the denoiser's
    input (image-to-video), and the same blend on the final latents."""
    mask = torch.ones(1, 1, *latents.shape[2:])  # float32, as the pipelines make it
    image = embeds.get(IMAGE_LATENTS)
    if image is not None:
        mask[:, :, 0] = 0
    patch = source.load_config("transformer")["patch_size"]
    tokens = mask[0][0][:, :: patch[1], :: patch[2]].flatten()

    def blend(latents):
        return latents if image is None else (1 - mask) * image + mask * latents

    return {
        "timestep_input": lambda i, t: (tokens * t).unsqueeze(0),  # (1, tokens)
        "model_input": lambda latents, t: blend(latents),
        "finish": blend,
    }
