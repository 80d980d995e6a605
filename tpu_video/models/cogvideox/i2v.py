"""CogVideoX image-to-video (diffusers `CogVideoXImageToVideoPipeline`, CogVideoX-5b-I2V and 1.5-5B-I2V).

The pipeline samples the image's latents from the VAE posterior with the run's generator, before it draws
the noise. So stage 1 stores the posterior (the encoder's moments, `image_latent_parameters`) and stage 2
hands it back to the pipeline's own `prepare_latents` in place of the VAE (`RecordedPosterior`): the
sample, the scaling, the padding and the noise come out in the pipeline's order from the stage-2 seed,
and a stage-2 `--seed` override gives what the pipeline gives for that seed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tpu_video.cli import parse_dtype
from tpu_video.engine.encoders import DeviceVAEEncoder
from tpu_video.engine.inputs import MediaInput
from utils import Request

from ..common import IMAGE
from .declarations import I2V_PIPELINE_CLASS

OFS = 2.0  # the pipeline's `ofs` value for transformers with an ofs embedding (CogVideoX 1.5 I2V)


def image_to_video(source) -> bool:
    return source.index.get("_class_name") == I2V_PIPELINE_CLASS


def media_inputs(source) -> tuple[MediaInput, ...]:
    """The image-to-video pipeline takes a first frame (no last frame)."""
    return (IMAGE.required_here(),) if image_to_video(source) else ()


def _pipeline(source, **components):
    """A CogVideoXImageToVideoPipeline holding only the given components, with the source's VAE geometry."""
    from diffusers import CogVideoXImageToVideoPipeline
    from diffusers.video_processor import VideoProcessor

    parts = dict.fromkeys(("tokenizer", "text_encoder", "vae", "transformer", "scheduler"))
    pipe = CogVideoXImageToVideoPipeline(**{**parts, **components})
    vae = source.load_config("vae")
    pipe.vae_scale_factor_spatial = 2 ** (len(vae["block_out_channels"]) - 1)
    pipe.vae_scale_factor_temporal = vae["temporal_compression_ratio"]
    pipe.vae_scaling_factor_image = vae["scaling_factor"]
    pipe.video_processor = VideoProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial)
    return pipe


def encode_inputs(source, request: Request, images: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The VAE posterior of the first frame, resized as the pipeline resizes it, in the request's dtype (the
    pipeline runs its VAE in the pipeline's dtype): the encoder's moments, which stage 2 samples from."""
    dtype = parse_dtype(request.dtype)
    vae = DeviceVAEEncoder(source.load("vae", dtype=dtype).eval(), runtime)
    pipe = _pipeline(source)
    image = pipe.video_processor.preprocess(images["image"], height=request.height, width=request.width).to(dtype=dtype)
    with torch.no_grad():
        posterior = vae.encode(image.unsqueeze(2)).latent_dist  # [B, C, F=1, H, W], as prepare_latents encodes
    return {"image_latent_parameters": posterior.parameters}


class RecordedPosterior:
    """Stands in for the VAE in the pipeline's `prepare_latents`: its `encode` returns stage 1's posterior."""

    def __init__(self, config: dict[str, Any], parameters: torch.Tensor) -> None:
        self.config = SimpleNamespace(**config)
        self.parameters = parameters

    def encode(self, image):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        return AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(self.parameters))


def noise_and_image_latents(source, request: Request, embeds, transformer, scheduler, num_frames, generator, dtype):
    """The pipeline's `prepare_latents` on stage 1's posterior: (initial latents, image latents), both
    [B, F, C, H, W], drawn from `generator` in the pipeline's order (the image sample first), and the
    generator's state between the two draws (the same method on a copy of the generator, given latents as
    its `latents=` path is: the image sample alone)."""
    pipe = _pipeline(source, transformer=transformer, scheduler=scheduler)
    parameters = embeds["image_latent_parameters"].to(dtype)
    object.__setattr__(pipe, "vae", RecordedPosterior(source.load_config("vae"), parameters))  # not a module
    image = torch.zeros(1, 3, request.height, request.width, dtype=dtype)  # prepare_latents reads its batch only
    channels = transformer.config.in_channels // 2
    args = (image, 1, channels, num_frames, request.height, request.width, dtype, "cpu")
    copy = torch.Generator("cpu")
    copy.set_state(generator.get_state())
    latents, image_latents = pipe.prepare_latents(*args, generator)
    pipe.prepare_latents(*args, copy, latents=torch.zeros_like(latents))
    return latents, image_latents, copy.get_state()


def extra_inputs(source, image_latents, dtype) -> list[tuple[torch.Tensor, tuple]]:
    """The guided transformer's image inputs: the image latents, and `ofs` where the transformer has one."""
    inputs = [(image_latents, ())]
    if source.load_config("transformer").get("ofs_embed_dim") is not None:
        inputs.append((torch.full((1,), OFS, dtype=dtype), ()))
    return inputs


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stage 1's image tensor for a plan: the posterior moments of one latent frame (2 x latent channels)."""
    vae = source.load_config("vae")
    spatial = 2 ** (len(vae["block_out_channels"]) - 1)
    shape = (1, 2 * vae["latent_channels"], 1, request.height // spatial, request.width // spatial)
    return {"image_latent_parameters": torch.zeros(shape, dtype=dtype)}


def plans_inputs(source) -> bool:
    """Stage 1's `--plan` compiles every model of encode_inputs."""
    return True
