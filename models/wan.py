"""Wan 2.1 and Wan 2.2 T2V (diffusers `WanPipeline`): one transformer, or two experts switched at a boundary.

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

Not supported: Wan 2.2 TI2V 5B (`expand_timesteps`, per-token timesteps) and the image-to-video pipelines.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from runtime.interface import DP, SP
from utils import Request, UserError, log

from . import tiny
from .common import NOISE_DTYPE, DeviceTextEncoder, constrain_block_inputs
from .denoise import DenoiseLoop, latents_record, multistep_state, restore_multistep_state
from .family import Preset
from .guidance import BATCH, Guided, cfg_combination

NAME = "wan"
PIPELINE_CLASSES = ("WanPipeline",)
# Splash tiles: 512/512/512, the tiles measured to compile on v5e, v5p, v6e and tpu7x for head dim 128
# (benchmarks/tpu_plan.py --tiles); 720p/81 frames (75,600 tokens) pads by 0.23%, the 512-token
# prompt not at all.
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
SUPPORTED = "Wan 2.1 T2V (1.3B, 14B) and Wan 2.2 T2V A14B"

# WanPipeline.__call__'s defaults (480p; the 14B models also run 720p: --height 720 --width 1280).
DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "fps": 16, "num_inference_steps": 50, "guidance_scale": 5.0}
MAX_SEQUENCE_LENGTH = 512  # the pipeline's prompt layout: valid tokens, then zeros up to 512
SHIFT_KEYS = ("flow_shift", "shift")  # UniPC's name for the flow shift, FlowMatchEuler's

# Each block's positional inputs: video tokens (on sp between blocks), prompt tokens, its modulation
# (batch, 6, width), and the final norm's input: all unsplit along the width. Left free, the
# partitioner splits them over tp and all-gathers them again before the next linear (XLA:CPU, 2x1x4
# mesh: 3 all-gathers of the video tokens per block and 3 more outside; with the pins, none).
BLOCK_INPUTS = {0: (DP, SP, None), 1: (DP, None, None), 2: (DP, None, None)}


# Requests ------------------------------------------------------------------------------------------


def _shift_key(source) -> str:
    config = source.load_config("scheduler")
    for key in SHIFT_KEYS:
        if key in config:
            return key
    raise UserError(f"the scheduler of {source.ref!r} ({config.get('_class_name')}) has no flow shift")


def request_defaults(source) -> dict[str, Any]:
    """The pipeline's defaults; the flow shift as the folder's scheduler records it."""
    shift = source.load_config("scheduler")[_shift_key(source)]
    return {**DEFAULTS, "flow_shift": shift, **source.preset_defaults}


def transformer_components(source) -> tuple[str, ...]:
    """The transformers this pipeline runs: one, or Wan 2.2's two experts (high noise first)."""
    return ("transformer", "transformer_2") if source.index.get("boundary_ratio") is not None else ("transformer",)


def validate_request(source, request: Request) -> None:
    if source.index.get("expand_timesteps"):
        raise UserError(f"--model {source.ref!r} is Wan 2.2 TI2V (expand_timesteps); supported: {SUPPORTED}")
    two_experts = source.index.get("boundary_ratio") is not None
    if two_experts and not isinstance(source.index.get("transformer_2"), list):
        raise UserError(f"--model {source.ref!r} sets boundary_ratio but has no transformer_2")
    if request.guidance_scale_2 is not None and not two_experts:
        raise UserError("--guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this one has one transformer")
    vae = source.load_config("vae")
    patch = source.load_config("transformer")["patch_size"]
    spatial, temporal = vae["scale_factor_spatial"], vae["scale_factor_temporal"]
    for key, multiple in (("height", spatial * patch[1]), ("width", spatial * patch[2])):
        value = getattr(request, key)
        if value <= 0 or value % multiple:
            raise UserError(f"--{key} {value} must be a positive multiple of {multiple}")
    if request.num_frames < 1 or (request.num_frames - 1) % temporal:
        raise UserError(f"--num_frames {request.num_frames} must be {temporal}n+1 (e.g. 81)")
    # The rotary embedding holds rope_max_seq_len positions per axis (diffusers' WanRotaryPosEmbed).
    positions = source.load_config("transformer").get("rope_max_seq_len", 1024)
    latent_frames = ((request.num_frames - 1) // temporal + 1) // patch[0]
    for key, count in (
        ("num_frames", latent_frames),
        ("height", request.height // (spatial * patch[1])),
        ("width", request.width // (spatial * patch[2])),
    ):
        if count > positions:
            raise UserError(
                f"--{key} {getattr(request, key)} makes {count} token positions along it, more than the "
                f"{positions} the transformer's rotary embedding holds (rope_max_seq_len)"
            )
    if request.flow_shift is None or request.flow_shift <= 0:
        raise UserError(f"--flow_shift {request.flow_shift} must be positive")


def cfg_enabled(guidance_scale: float) -> bool:
    """WanPipeline runs the unconditional branch for a (first) guidance scale above 1."""
    return guidance_scale > 1.0


def _pipeline(source, **components):
    """A WanPipeline holding only the given components, with the source's VAE geometry."""
    from diffusers import WanPipeline

    names = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer", "transformer_2")
    pipe = WanPipeline(**{**dict.fromkeys(names), **components})
    vae = source.load_config("vae")
    pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = (
        vae["scale_factor_spatial"],
        vae["scale_factor_temporal"],
    )
    return pipe


# Stage 1 -------------------------------------------------------------------------------------------


def encode_prompts(source, request: Request, dtype: torch.dtype, runtime) -> dict[str, torch.Tensor]:
    """UMT5 through the pipeline's own `encode_prompt` (its cleaning, 512-token layout, trimming and zero
    padding), for the prompt and the negative prompt."""
    pipe = _pipeline(
        source,
        tokenizer=source.load("tokenizer"),
        text_encoder=DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime),
    )
    with torch.no_grad():
        prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=True,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            device=runtime.device,
            dtype=dtype,
        )
    return {"prompt_embeds": prompt_embeds.cpu(), "negative_prompt_embeds": negative_prompt_embeds.cpu()}


# Stage 2 -------------------------------------------------------------------------------------------


def transformer_rules(tp_mode: str):
    import sharding

    return sharding.wan_transformer_rules(tp_mode)


class GuidedTransformer(Guided):
    """One expert's denoiser evaluation: [cond, uncond] as one batch of 2 (on `dp`), where the pipeline
    makes two batch-1 calls, and its guidance expression with this expert's scale."""

    CFG_ORDER = ("cond", "uncond")

    def __init__(self, transformer, dtype: torch.dtype, do_cfg: bool, guidance_scale: float, constrain=None) -> None:
        super().__init__(transformer, do_cfg, constrain)
        self.dtype = dtype  # the pipeline's `transformer_dtype` (fp32-kept modules aside)
        self.guidance_scale = guidance_scale
        if constrain is not None:
            constrain_block_inputs([*transformer.blocks, transformer.norm_out], constrain, BLOCK_INPUTS)

    def forward(self, latents, timestep, prompt_embeds):
        def predict(model_input):
            return self.transformer(
                hidden_states=model_input,
                timestep=timestep.expand(model_input.shape[0]),
                encoder_hidden_states=prompt_embeds,
                return_dict=False,
            )[0]

        combine = functools.partial(cfg_combination, guidance_scale=self.guidance_scale)
        return self.guided(latents.to(self.dtype), predict, combine)


def planning_embeds(source, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model (to plan before encoding)."""
    shape = (1, MAX_SEQUENCE_LENGTH, source.load_config("transformer")["text_dim"])
    return {"prompt_embeds": torch.zeros(shape, dtype=dtype), "negative_prompt_embeds": torch.zeros(shape, dtype=dtype)}


def boundary_timestep(source, scheduler) -> float | None:
    """Where Wan 2.2 switches experts (the pipeline's expression); None with one transformer."""
    ratio = source.index.get("boundary_ratio")
    return None if ratio is None else ratio * scheduler.config.num_train_timesteps


def denoise_loop(source, request: Request, embeds, dtype, transformers, runtime, tp_mode):
    """WanPipeline's loop as a DenoiseLoop over its experts, and the function giving stage 2's latents
    and record. Latents stay float32 between steps, as in the pipeline."""
    scheduler = source.load("scheduler")
    scheduler.register_to_config(**{_shift_key(source): request.flow_shift})
    do_cfg = cfg_enabled(request.guidance_scale)
    scales = (
        request.guidance_scale,
        request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2,
    )
    names = transformer_components(source)
    guided = tuple(
        GuidedTransformer(transformers[name], dtype, do_cfg, scale, runtime.constrain)
        for name, scale in zip(names, scales, strict=False)
    )
    pipe = _pipeline(source, transformer=transformers["transformer"], scheduler=scheduler)

    prompt_embeds = embeds["prompt_embeds"].to(dtype)
    if do_cfg:
        prompt_embeds = torch.cat([prompt_embeds, embeds["negative_prompt_embeds"].to(dtype)])
    generator = torch.Generator("cpu").manual_seed(request.seed)
    scheduler.set_timesteps(request.num_inference_steps, device="cpu")
    timesteps = scheduler.timesteps
    latents = pipe.prepare_latents(
        1,
        transformers["transformer"].config.in_channels,
        request.height,
        request.width,
        request.num_frames,
        NOISE_DTYPE,
        "cpu",
        generator,
    )
    boundary = boundary_timestep(source, scheduler)

    def expert(i, t) -> int:
        return 0 if boundary is None or t >= boundary else 1

    def step(i, t, noise_pred, latents, carry):
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        return latents, multistep_state(scheduler)

    def on_start(start, carry):
        scheduler.set_begin_index(start)  # the pipeline sets 0; --resume continues at `start`
        restore_multistep_state(scheduler, carry)

    loop = DenoiseLoop(
        guided=guided,
        expert=expert,
        rules=transformer_rules(tp_mode),
        static_inputs=((prompt_embeds, BATCH),),
        timesteps=timesteps,
        latents=latents,
        generator=generator,
        step=step,
        on_start=on_start,
        expert_names=tuple(names),
        cache_branches=("cond", "uncond") if do_cfg else ("cond",),  # the pipeline's cache contexts
    )
    switch = [i for i, t in enumerate(timesteps) if expert(i, t) == 1]
    if boundary is not None:
        where = f"from step {switch[0] + 1} of {len(timesteps)}" if switch else "never (the schedule stays above it)"
        log(f"two experts: transformer_2 takes over at timesteps below {boundary:g}, {where}")
    extra = {"experts": list(names), "boundary_timestep": boundary, "expert_2_from_step": switch[0] if switch else None}

    def finish(latents):
        return latents, latents_record(scheduler, do_cfg, latents_normalization(source), **extra)

    return loop, finish


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


# Tiny presets (models/tiny.py builds them) ---------------------------------------------------------

TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 16, "num_inference_steps": 6}
PRESETS = {
    "tiny-wan2.1": Preset(NAME, functools.partial(tiny.wan, "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2": Preset(NAME, functools.partial(tiny.wan, "2.2"), TINY_DEFAULTS),
}
