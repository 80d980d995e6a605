"""CogVideoX's three stage bodies (diffusers `CogVideoXPipeline`; image-to-video through i2v.py).

The math stays in diffusers: prompt encoding, initial noise, rotary embeddings, the scheduler and the
VAE post-processing are the pipeline's own methods, called on a pipeline object that holds only the
components a stage has loaded. What is ours is the cut into stages and the transformer call, which
stage 2 hands to a runtime (torchax on a JAX device).
"""

from __future__ import annotations

import torch

from tpu_video.cli import UserError
from tpu_video.engine.denoise import NOISE_DTYPE, DenoiseLoop, latents_record
from tpu_video.engine.encoders import DeviceTextEncoder, t5_prompt_encoder
from tpu_video.engine.guidance import BATCH
from utils import Request

from ..common import recorded_scaling_factor, vae_scaling_factor
from . import i2v
from .config import Geometry, cfg_enabled
from .transformer import GuidedTransformer, make_jit_safe, transformer_rules


def _pipeline(**components):
    """A CogVideoXPipeline holding only the given components, so its helper methods can be reused."""
    from diffusers import CogVideoXPipeline

    parts = dict.fromkeys(("tokenizer", "text_encoder", "vae", "transformer", "scheduler"))
    parts.update(components)
    return CogVideoXPipeline(**parts)


# Stage 1 -------------------------------------------------------------------------------------------


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """T5 loaded once; per request the embeddings of the prompt and negative prompt, padded to the
    transformer's text length."""
    text_encoder = DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime)
    pipe = _pipeline(tokenizer=source.load("tokenizer"), text_encoder=text_encoder)
    return t5_prompt_encoder(pipe, Geometry.of(source).text_tokens, runtime, dtype)


# Stage 2 -------------------------------------------------------------------------------------------


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model (to plan before encoding)."""
    transformer = source.load_config("transformer")
    shape = (1, transformer["max_text_seq_length"], transformer["text_embed_dim"])
    embeds = {name: torch.zeros(shape, dtype=dtype) for name in ("prompt_embeds", "negative_prompt_embeds")}
    if i2v.image_to_video(source):
        embeds.update(i2v.planning_embeds(source, request, dtype))
    return embeds


def start_from(source, request: Request, tensors: dict[str, torch.Tensor], embeds) -> torch.Tensor:
    """CogVideoXPipeline's `prepare_latents` with `latents=` given: those latents in the pipeline's (B, F, C, H,
    W) (it scales them by its sampler's initial sigma, 1 for both of its samplers); the generator goes on from
    before the noise it skips (DenoiseLoop.noise_state: the DPM sampler draws from it at every step; with
    image-to-video, after the image sample, which the pipeline still draws). CogVideoX 1.5 pads its latent frames
    to whole temporal patches and its `latents=` path takes the pad back from the pipeline's own output, which
    stage 2's file does not keep."""
    if Geometry.of(source).patch_t is not None:
        raise UserError(
            "--start_latents: CogVideoX 1.5 pads its latent frames to whole temporal patches, and stage 2's latents "
            "do not keep the pad its pipeline would start from; it denoises from noise only here"
        )
    return tensors["latents"].permute(0, 2, 1, 3, 4).to(NOISE_DTYPE)


def denoise_loop(
    source,
    request: Request,
    embeds: dict[str, torch.Tensor],
    dtype,
    transformers,
    runtime,
    tp_mode,
    *,
    planning: bool,
):
    """The pipeline's denoising loop as a DenoiseLoop for `transformer` on `runtime`, and the function that
    turns its final latents into stage 2's (B, C, F, H, W) latents and record.

    The scheduler stays in PyTorch on the host (its step has Python branches on tensor values and draws
    noise from the CPU generator), exactly as the pipeline runs it.
    """
    from diffusers import CogVideoXDPMScheduler
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import retrieve_timesteps

    geometry = Geometry.of(source)
    transformer = make_jit_safe(transformers["transformer"])
    scheduler = source.load("scheduler")
    pipe = _pipeline(transformer=transformer, scheduler=scheduler)
    pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = geometry.spatial, geometry.temporal

    do_cfg = cfg_enabled(request.guidance_scale)
    prompt_embeds = embeds["prompt_embeds"].to(dtype)
    if do_cfg:
        prompt_embeds = torch.cat([embeds["negative_prompt_embeds"].to(dtype), prompt_embeds])

    generator = torch.Generator("cpu").manual_seed(request.seed)
    timesteps, _ = retrieve_timesteps(scheduler, request.num_inference_steps, "cpu")
    # CogVideoX 1.5 pads the latent frames to a multiple of patch_size_t and drops the pad after denoising.
    latent_frames = (request.num_frames - 1) // geometry.temporal + 1
    pad_frames = 0
    if geometry.patch_t is not None and latent_frames % geometry.patch_t:
        pad_frames = geometry.patch_t - latent_frames % geometry.patch_t
    num_frames = request.num_frames + pad_frames * geometry.temporal
    image_inputs, noise_state = [], None
    if i2v.image_to_video(source):  # the image sample, then the noise, in the pipeline's dtype
        latents, image_latents, noise_state = i2v.noise_and_image_latents(
            source, request, embeds, transformer, scheduler, num_frames, generator, dtype
        )
        image_inputs = i2v.extra_inputs(source, image_latents, dtype)
    else:
        channels = transformer.config.in_channels
        args = (num_frames, request.height, request.width, NOISE_DTYPE, "cpu", generator)
        noise_state = generator.get_state()  # the DPM sampler draws from the generator at every step
        latents = pipe.prepare_latents(1, channels, *args).to(dtype)
    extra_step_kwargs = pipe.prepare_extra_step_kwargs(generator, 0.0)
    image_rotary_emb = None
    if transformer.config.use_rotary_positional_embeddings:
        image_rotary_emb = pipe._prepare_rotary_positional_embeddings(
            request.height, request.width, latents.size(1), "cpu"
        )
    is_dpm = isinstance(scheduler, CogVideoXDPMScheduler)

    def step(i, t, noise_pred, latents, carry):
        if is_dpm:
            latents, carry["old_pred_original_sample"] = scheduler.step(
                noise_pred,
                carry.get("old_pred_original_sample"),
                t,
                timesteps[i - 1] if i > 0 else None,
                latents,
                **extra_step_kwargs,
                return_dict=False,
            )
        else:
            latents = scheduler.step(noise_pred, t, latents, **extra_step_kwargs, return_dict=False)[0]
        return latents.to(prompt_embeds.dtype), carry

    loop = DenoiseLoop(
        guided=(GuidedTransformer(transformer, do_cfg, runtime.constrain),),
        rules=transformer_rules(tp_mode),
        static_inputs=(
            (prompt_embeds, BATCH),
            (image_rotary_emb, ()),
            (torch.tensor(request.guidance_scale, dtype=torch.float32), ()),
            *image_inputs,
        ),
        timesteps=timesteps,
        latents=latents,
        generator=generator,
        step=step,
        model_input=scheduler.scale_model_input,
        cache_branches=("cond_uncond",),  # the pipeline's one cache context for its batched call
        noise_state=noise_state,
    )

    def finish(latents):
        latents = latents[:, pad_frames:].permute(0, 2, 1, 3, 4).contiguous()
        return {"latents": latents}, latents_record(
            scheduler, do_cfg, vae_scaling_factor(source), dropped_pad_latent_frames=pad_frames
        )

    return loop, finish


# Stage 3 -------------------------------------------------------------------------------------------


class Decoder(torch.nn.Module):
    """VAE decode of diffusion-space latents (B, C, F, H, W) to pixels in [-1, 1], as one graph."""

    def __init__(self, vae: torch.nn.Module, normalization: dict) -> None:
        super().__init__()
        self.vae = vae
        self.scaling_factor = recorded_scaling_factor(normalization)

    def forward(self, latents):
        # Same expression as CogVideoXPipeline.decode_latents, so the rounding matches too.
        latents = 1 / self.scaling_factor * latents
        return self.vae.decode(latents, return_dict=False)[0]


def video_processor(source):
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=Geometry.of(source).spatial)
