"""Wan 2.1 and Wan 2.2 (diffusers `WanPipeline` and `WanImageToVideoPipeline`): one transformer, or two
experts switched at a boundary; text-to-video, or image-to-video from a first (and last) frame.

Wan 2.2 A14B's pipeline runs `transformer` while the timestep is at or above `boundary_ratio *
num_train_timesteps` and `transformer_2` after it, each with its own guidance scale. Here both experts
are placed on the mesh once and each is its own compiled program; the loop picks one per step with the
pipeline's own comparison.

The stock transformer traces as it is: its rotary embedding writes `out[..., 0::2]` in place, the
pattern family that XLA:CPU miscompiled for CogVideoX, but here every element of a fresh tensor is
written, and tests/test_wan.py shows the jitted forward equal to eager PyTorch on every mesh.
Wan has no attention masks: the prompt is zero-padded to 512 tokens and every token, padding
included, is a key, as in the pipeline. The published folders' scheduler is UniPC, a multistep
solver whose history is part of the loop state (checkpoints carry it: denoise.multistep_state).

Wan 2.2 TI2V-5B (`expand_timesteps`: a timestep per video token, the 48-channel VAE, an optional image):
ti2v.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.denoise import NOISE_DTYPE, DenoiseLoop, latents_record, multistep_state, restore_multistep_state
from tpu_video.engine.encoders import DeviceTextEncoder, t5_prompt_encoder
from tpu_video.engine.guidance import BATCH
from utils import Request

from ..common import flow_scheduler
from . import animate, animate_inputs, ti2v, v2v, vace
from .config import cfg_enabled, image_to_video, stock_pipeline, transformer_components
from .i2v import image_conditioning
from .transformer import MAX_SEQUENCE_LENGTH, GuidedTransformer, transformer_rules

# Stage 1 -------------------------------------------------------------------------------------------


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """UMT5 loaded once; per request the pipeline's own `encode_prompt` (its cleaning, 512-token layout,
    trimming and zero padding) of the prompt and the negative prompt."""
    text_encoder = DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime)
    pipe = stock_pipeline(source, tokenizer=source.load("tokenizer"), text_encoder=text_encoder)
    return t5_prompt_encoder(pipe, MAX_SEQUENCE_LENGTH, runtime, dtype)


# Stage 2 -------------------------------------------------------------------------------------------


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model and request (to plan before encoding)."""
    transformer = source.load_config("transformer")
    shape = (1, MAX_SEQUENCE_LENGTH, transformer["text_dim"])
    embeds = {name: torch.zeros(shape, dtype=dtype) for name in ("prompt_embeds", "negative_prompt_embeds")}
    if vace.is_vace(source):
        embeds[vace.CONTROL] = vace.planning_control(source, request)
    if animate.is_animate(source):
        embeds.update(animate_inputs.planning_embeds(source, request))
    if image_to_video(source):
        vae = source.load_config("vae")
        spatial, temporal = vae["scale_factor_spatial"], vae["scale_factor_temporal"]
        latent = ((request.num_frames - 1) // temporal + 1, request.height // spatial, request.width // spatial)
        embeds["condition"] = torch.zeros(1, temporal + vae["z_dim"], *latent)  # float32, as stage 1 writes it
        if transformer.get("image_dim") is not None:
            vision = source.load_config("image_encoder")
            tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + 1  # CLIP: patches and the class token
            embeds["image_embeds"] = torch.zeros(1, tokens, transformer["image_dim"])
    return embeds


def boundary_timestep(source, scheduler) -> float | None:
    """Where Wan 2.2 switches experts (the pipeline's expression); None with one transformer."""
    ratio = source.index.get("boundary_ratio")
    return None if ratio is None else ratio * scheduler.config.num_train_timesteps


def denoise_loop(source, request: Request, embeds, dtype, transformers, runtime, tp_mode, *, planning: bool):
    """WanPipeline's (or WanImageToVideoPipeline's) loop as a DenoiseLoop over its experts, and the function
    giving stage 2's latents and record. Latents stay float32 between steps, as in the pipeline."""
    from diffusers import WanPipeline

    do_cfg = cfg_enabled(request.guidance_scale)
    scales = (
        request.guidance_scale,
        request.guidance_scale if request.option("guidance_scale_2") is None else request.option("guidance_scale_2"),
    )
    names = transformer_components(source)
    per_token = ti2v.expand_timesteps(source)
    control, animating = vace.is_vace(source), animate.is_animate(source)
    guided_class = vace.GuidedVACE if control else animate.GuidedAnimate if animating else GuidedTransformer
    guided = tuple(
        guided_class(transformers[name], dtype, do_cfg, scale, runtime.constrain, per_token, runtime.barrier)
        for name, scale in zip(names, scales, strict=False)
    )
    prompt_embeds = embeds["prompt_embeds"].to(dtype)
    if do_cfg:
        prompt_embeds = torch.cat([prompt_embeds, embeds["negative_prompt_embeds"].to(dtype)])
    generator = torch.Generator("cpu").manual_seed(request.seed)

    def scheduled():
        scheduler = flow_scheduler(source, request.flow_shift, request.option("scheduler"))
        scheduler.set_timesteps(request.num_inference_steps, device="cpu")
        return scheduler

    scheduler = scheduled()
    boundary = boundary_timestep(source, scheduler)

    def expert(i, t) -> int:
        return 0 if boundary is None or t >= boundary else 1

    def loop_for(scheduler, conditioning, latents, first: int = 0, **parts) -> DenoiseLoop:
        """The loop from `latents` over `scheduler`'s timesteps from index `first` (video-to-video starts part
        way through), with the guided transformer's inputs after the prompt (`conditioning`)."""

        def step(i, t, noise_pred, latents, carry):
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            return latents, multistep_state(scheduler)

        def on_start(start, carry):
            # WanPipeline sets 0; the video-to-video pipeline sets none, so its scheduler finds the truncated
            # schedule's first timestep at `first`; --resume continues `start` steps later.
            scheduler.set_begin_index(first + start)
            restore_multistep_state(scheduler, carry)

        return DenoiseLoop(
            guided=guided,
            expert=expert,
            rules=transformer_rules(tp_mode),
            static_inputs=((prompt_embeds, BATCH), *conditioning),
            timesteps=scheduler.timesteps[first:],
            latents=latents,
            generator=generator,
            step=step,
            on_start=on_start,
            expert_names=tuple(names),
            cache_branches=("cond", "uncond") if do_cfg else ("cond",),  # the pipeline's cache contexts
            **parts,
        )

    extra = {"experts": list(names), "boundary_timestep": boundary}
    record = functools.partial(latents_record, scheduler, do_cfg, latents_normalization(source))
    if animating:  # segments in order, each from its own noise and a fresh scheduler, as the pipeline runs them
        decoder = functools.partial(Decoder, normalization=latents_normalization(source))
        pipeline = functools.partial(stock_pipeline, source)
        chain = animate.SegmentLoops(source, request, embeds, dtype, do_cfg, generator, pipeline, decoder, runtime)
        loop = chain.first(lambda conditioning, latents: loop_for(scheduled(), conditioning, latents))
        return loop, lambda latents: chain.finish(latents, record(**extra))
    conditioning = image_conditioning(source, embeds, dtype)
    # WanPipeline's noise draw; the image-to-video pipeline draws the same, with the VAE's channel count
    # (its transformer's input adds the condition's channels); VACE's adds a latent frame per reference image.
    channels = source.load_config("vae")["z_dim"] if conditioning else transformers["transformer"].config.in_channels
    references = 0
    if control:  # the control latents and per-layer scales, and the reference frames' extra noise
        conditioning, references = vace.loop_inputs(source, request, embeds, dtype, transformers[names[0]])
    frames = request.num_frames + references * source.load_config("vae")["scale_factor_temporal"]
    sizes = (1, channels, request.height, request.width, frames)
    latents = WanPipeline.prepare_latents(stock_pipeline(source), *sizes, NOISE_DTYPE, "cpu", generator)
    first = 0  # video-to-video starts part way through the schedule, from the video's noised latents
    if v2v.VIDEO_LATENTS in embeds:
        latents, first = v2v.loop_start(scheduler, request, embeds, latents)
    ti2v_parts = ti2v.loop_parts(source, embeds, latents) if per_token else {}
    parts = {key: ti2v_parts[key] for key in ("timestep_input", "model_input") if key in ti2v_parts}
    loop = loop_for(scheduler, conditioning, latents, first, **parts)
    switch = [i for i, t in enumerate(loop.timesteps) if expert(i, t) == 1]
    if boundary is not None:
        steps = len(loop.timesteps)
        where = f"from step {switch[0] + 1} of {steps}" if switch else "never (the schedule stays above it)"
        log(f"two experts: transformer_2 takes over at timesteps below {boundary:g}, {where}")
    extra["expert_2_from_step"] = switch[0] if switch else None

    def finish(latents):
        latents = ti2v_parts["finish"](latents) if ti2v_parts else latents
        latents = latents[:, :, references:]  # VACE: the reference frames dropped, as before the pipeline's decode
        return {"latents": latents}, record(**extra)

    return loop, finish


def start_from(source, request: Request, tensors: dict[str, torch.Tensor], embeds) -> torch.Tensor:
    """WanPipeline's `prepare_latents` with `latents=` given: those latents, in the loop's float32 (stage 2
    writes the loop's latents as they are). TI2V-5B blends its first frame into the noise (ti2v.loop_parts):
    not yet."""
    if ti2v.expand_timesteps(source):
        raise UserError("--start_latents: Wan TI2V-5B denoises from noise only (its first frame joins the noise)")
    if vace.is_vace(source) or animate.is_animate(source):  # latents= would hold the frames stage 2 drops
        raise UserError(
            f"--start_latents: Wan {'VACE' if vace.is_vace(source) else 'Animate'} denoises from noise only here"
        )
    return tensors["latents"].to(NOISE_DTYPE)


# Stage 3 -------------------------------------------------------------------------------------------


def latents_normalization(source) -> dict[str, Any]:
    """Stage 2's latents are in the transformer's space: per-channel (x - mean) / std of the VAE's latents."""
    vae = source.load_config("vae")
    return {"method": "mean_std", "latents_mean": list(vae["latents_mean"]), "latents_std": list(vae["latents_std"])}


class Decoder(torch.nn.Module):
    """The pipeline's de-normalisation (same expression, so the same rounding) and the Wan VAE decode."""

    def __init__(self, vae: torch.nn.Module, normalization: dict[str, Any]) -> None:
        super().__init__()
        if normalization.get("method") != "mean_std":
            raise UserError(f"Wan latents are mean/std-normalised; stage 2 recorded {normalization}")
        self.vae = vae
        shape = (1, len(normalization["latents_mean"]), 1, 1, 1)
        dtype = next(vae.parameters()).dtype
        self.register_buffer("latents_mean", torch.tensor(normalization["latents_mean"]).view(shape).to(dtype))
        self.register_buffer("latents_std", 1.0 / torch.tensor(normalization["latents_std"]).view(shape).to(dtype))

    def forward(self, latents):
        latents = latents.to(self.latents_mean.dtype)
        latents = latents / self.latents_std + self.latents_mean
        return self.vae.decode(latents, return_dict=False)[0]


def video_processor(source):
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=source.load_config("vae")["scale_factor_spatial"])
