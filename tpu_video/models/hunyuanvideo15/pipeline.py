"""HunyuanVideo-1.5's stage bodies (diffusers `HunyuanVideo15Pipeline`; image-to-video through i2v.py):
prompt encoding with both encoders and the flow-matching denoising loop, on the pipeline's own methods."""

from __future__ import annotations

import torch

from tpu_video.engine.denoise import NOISE_DTYPE, DenoiseLoop, latents_record
from tpu_video.engine.encoders import DeviceTextEncoder
from tpu_video.engine.guidance import BATCH
from utils import Request

from .. import common
from . import i2v
from .config import Geometry, cfg_enabled
from .transformer import GuidedTransformer, transformer_rules


def _pipeline(source, **components):
    """A HunyuanVideo15Pipeline holding only the given components, so its helper methods can be reused,
    with the padded lengths of `source`'s preset, if it has any (declarations.TINY_LENGTHS).

    Its constructor reads the VAE's config, so without a real VAE it gets one built from `source`'s VAE
    config on the meta device (no weights, no memory)."""
    from diffusers import HunyuanVideo15Pipeline

    names = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2", "guider")
    if "vae" not in components:
        cls = source.component_class("vae")
        with torch.device("meta"):
            components["vae"] = cls.from_config(source.load_config("vae"))
    return source.configure(HunyuanVideo15Pipeline(**{**dict.fromkeys(names), **components}))


# Stage 1 -------------------------------------------------------------------------------------------

PROMPT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """Both encoders loaded once; per request the pipeline's own `encode_prompt` (Qwen2.5-VL with its chat
    template and crop; ByT5 on the quoted text only) of the prompt and the negative prompt, masks included."""
    pipe = _pipeline(
        source,
        tokenizer=source.load("tokenizer"),
        text_encoder=DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime, hidden_states=True),
        tokenizer_2=source.load("tokenizer_2"),
        text_encoder_2=DeviceTextEncoder(source.load("text_encoder_2", dtype=dtype).eval(), runtime),
    )

    def encode(request: Request) -> dict[str, torch.Tensor]:
        tensors = {}
        with torch.no_grad():
            for prefix, text in (("", request.prompt), ("negative_", request.negative_prompt)):
                encoded = pipe.encode_prompt(prompt=text, device=runtime.device, dtype=dtype, batch_size=1)
                tensors.update({prefix + key: value.cpu() for key, value in zip(PROMPT_KEYS, encoded, strict=True)})
        return tensors

    return encode


# Stage 2 -------------------------------------------------------------------------------------------


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model (to plan before encoding)."""
    transformer = source.load_config("transformer")
    pipe = _pipeline(source)
    shapes = {
        "prompt_embeds": ((1, pipe.tokenizer_max_length, transformer["text_embed_dim"]), dtype),
        "prompt_embeds_mask": ((1, pipe.tokenizer_max_length), torch.int64),
        "prompt_embeds_2": ((1, pipe.tokenizer_2_max_length, transformer["text_embed_2_dim"]), dtype),
        "prompt_embeds_mask_2": ((1, pipe.tokenizer_2_max_length), torch.int64),
    }
    zeros = {key: torch.zeros(shape, dtype=kind) for key, (shape, kind) in shapes.items()}
    image = i2v.planning_embeds(source, request, dtype) if i2v.image_to_video(source) else {}
    return {**zeros, **{f"negative_{key}": value for key, value in zeros.items()}, **image}


def meanflow_timesteps(timesteps: torch.Tensor):
    """The step-distilled checkpoints' timestep input: step i's timestep and the next one's (0 after the last),
    the pipeline's `timestep_r`."""
    following = torch.cat([timesteps[1:], timesteps.new_zeros(1)])
    return lambda i, t: torch.stack([t, following[i]])


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
    """The pipeline's flow-matching loop as a DenoiseLoop for `transformer` on `runtime`, and the function
    that turns its final latents into stage 2's latents and record."""
    import numpy as np
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

    geometry = Geometry.of(source)
    scheduler = common.flow_scheduler(source, request.flow_shift)
    guider = source.load("guider")
    guider.guidance_scale = request.guidance_scale
    do_cfg = cfg_enabled(request.guidance_scale)
    transformer = transformers["transformer"]
    pipe = _pipeline(source, transformer=transformer, scheduler=scheduler)

    prefixes = ("", "negative_") if do_cfg else ("",)  # [cond, uncond], the guider's order
    text_inputs = [torch.cat([embeds[prefix + key] for prefix in prefixes]).to(dtype) for key in PROMPT_KEYS]
    generator = torch.Generator("cpu").manual_seed(request.seed)
    steps = request.num_inference_steps
    sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas)
    latents = pipe.prepare_latents(
        1, geometry.latent_channels, request.height, request.width, request.num_frames, NOISE_DTYPE, "cpu", generator
    ).to(dtype)
    image_inputs = i2v.transformer_image_inputs(source, embeds, latents, pipe, dtype)

    def step(i, t, noise_pred, latents, carry):
        return scheduler.step(noise_pred, t, latents, return_dict=False)[0], carry

    loop = DenoiseLoop(
        guided=(GuidedTransformer(transformer, guider, do_cfg, runtime.constrain),),
        rules=transformer_rules(tp_mode),
        static_inputs=(*((tensor, BATCH) for tensor in text_inputs), *image_inputs),
        timesteps=timesteps,
        latents=latents,
        generator=generator,
        step=step,
        on_start=lambda step, carry: scheduler.set_begin_index(step),  # it counts its own steps (--resume)
        timestep_input=meanflow_timesteps(timesteps) if transformer.config.use_meanflow else DenoiseLoop.timestep_input,
        cache_branches=("pred_cond", "pred_uncond") if do_cfg else ("pred_cond",),  # the guider's cache contexts
    )
    return loop, lambda latents: (
        {"latents": latents},
        latents_record(scheduler, do_cfg, common.vae_scaling_factor(source), flow_shift=request.flow_shift),
    )


def start_from(source, request: Request, tensors: dict[str, torch.Tensor], embeds) -> torch.Tensor:
    """HunyuanVideo15Pipeline's (and the image-to-video pipeline's) `prepare_latents` with `latents=` given:
    those latents (stage 2 writes the loop's latents as they are; engine.passes.started casts them to the loop's
    dtype). The flow scheduler draws nothing, and the image's latents are stage 1's (the posterior's mode), so
    nothing else depends on the noise not drawn."""
    return tensors["latents"].to(NOISE_DTYPE)
