"""LTX-2 (diffusers `LTX2Pipeline`): a video and an audio stream denoised together by one transformer.

Stage 1 runs the pipeline's own Gemma 3 prompt encoding (left padding to 1024 tokens, every hidden state
stacked) and its text connectors, and writes each prompt's connector outputs: the video and audio streams'
text tokens and their mask. Stage 2 draws the noise as the pipeline does (video first, then audio), runs
every guidance pass of a step as one compiled batch (transformer.py) and steps both streams with one
FlowMatch Euler scheduler; it writes both latents as the pipeline returns them with `output_type="latent"`:
unpacked and de-normalised to their VAEs' spaces, so nothing is left for stage 3 to undo.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.denoise import DenoiseLoop, latents_record
from tpu_video.engine.encoders import DeviceTextEncoder
from tpu_video.engine.guidance import BATCH
from utils import Request

from ..common import NOISE_DTYPE
from .config import (
    MAX_SEQUENCE_LENGTH,
    audio_frames,
    audio_temporal_ratio,
    image_to_video,
    latent_grid,
    stock_pipeline,
    vae_ratios,
)
from .connectors import DeviceConnectors
from .guidance import resolve_guidance
from .i2v import IMAGE_LATENTS, conditioning_mask
from .transformer import ROPES, GuidedTransformer, rope_tables, transformer_rules

STAGE1_TENSORS = ("connector_prompt_embeds", "connector_audio_prompt_embeds", "connector_attention_mask")

# Stage 1 -------------------------------------------------------------------------------------------


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """Gemma 3 (its language model) and the connectors loaded once, both on the runtime; per request the
    pipeline's `encode_prompt` of the prompt and the negative prompt, then its connectors on both."""
    gemma = source.load("text_encoder", dtype=dtype).eval()
    text_encoder = DeviceTextEncoder(gemma.model.language_model, runtime, hidden_states=True)
    connectors = DeviceConnectors(source.load("connectors", dtype=dtype).eval(), runtime)
    pipe = stock_pipeline(source, tokenizer=source.load("tokenizer"), text_encoder=text_encoder, connectors=connectors)

    def encode(request: Request) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
                prompt=request.prompt,
                negative_prompt=request.negative_prompt,
                do_classifier_free_guidance=True,
                max_sequence_length=MAX_SEQUENCE_LENGTH,
                device="cpu",
                dtype=dtype,
            )
            # The pipeline runs the connectors on the [negative, positive] batch; so does stage 1.
            outputs = connectors(torch.cat([negative, positive]), torch.cat([negative_mask, positive_mask]))
        tensors = {}
        for name, output in zip(STAGE1_TENSORS, outputs, strict=True):
            uncond, cond = output.chunk(2)
            tensors[name], tensors[f"negative_{name}"] = cond.contiguous(), uncond.contiguous()
        return tensors

    return encode


# Stage 2 -------------------------------------------------------------------------------------------


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model (to plan before encoding)."""
    transformer = source.load_config("transformer")
    connectors = source.load_config("connectors")
    widths = {"connector_prompt_embeds": connectors.get("video_hidden_dim", transformer["caption_channels"])}
    widths["connector_audio_prompt_embeds"] = connectors.get("audio_hidden_dim", transformer["caption_channels"])
    if not connectors.get("per_modality_projections", False):
        widths = dict.fromkeys(widths, transformer["caption_channels"])
    embeds = {}
    for prefix in ("", "negative_"):
        for name, width in widths.items():
            embeds[prefix + name] = torch.zeros(1, MAX_SEQUENCE_LENGTH, width, dtype=dtype)
        embeds[prefix + "connector_attention_mask"] = torch.ones(1, MAX_SEQUENCE_LENGTH, dtype=torch.int64)
    if image_to_video(source):
        _, height, width = latent_grid(source, request)
        embeds[IMAGE_LATENTS] = torch.zeros(1, transformer["in_channels"], 1, height, width)
    return embeds


def latent_statistics(source, component: str, planning: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A VAE's `latents_mean` and `latents_std` buffers (the pipeline's de-normalisation), read from its
    checkpoint without loading the VAE. `planning` (--plan, or a configs-only source, which has no values):
    zeros and ones of the buffers' shape. Never inferred from a module's parameters: placed torchax weights
    and directly loaded ones report `is_meta` in every real run."""
    from safetensors import safe_open

    from tpu_video.engine.direct_load import checkpoint_paths
    from tpu_video.engine.meta import meta_module

    if planning or source.configs_only:
        shape = meta_module(source, component, torch.float32).latents_mean.shape
        return torch.zeros(shape), torch.ones(shape)

    try:
        paths = checkpoint_paths(source.location, component)
    except OSError:
        paths = []
    for path in paths:
        with safe_open(path, framework="pt") as file:
            if "latents_mean" in file.keys():
                return file.get_tensor("latents_mean").float(), file.get_tensor("latents_std").float()
    vae = source.load(component)
    return vae.latents_mean.float(), vae.latents_std.float()


def denormalized(source, tensors: dict[str, torch.Tensor], planning: bool = False) -> dict[str, torch.Tensor]:
    """Stage 2's `latents` (B, C, F, H, W) and `audio_latents` (B, C, L, M), normalised as the transformer
    denoises them, de-normalised to their VAEs' spaces as LTX2Pipeline does after its loop (the audio on its
    packed features, the video with the VAE's scaling factor), in float32."""
    from diffusers import LTX2Pipeline

    mean, std = latent_statistics(source, "vae", planning)
    scaling = source.load_config("vae").get("scaling_factor", 1.0)
    video = LTX2Pipeline._denormalize_latents(tensors["latents"].float(), mean, std, scaling)
    audio = tensors["audio_latents"].float()
    mean, std = latent_statistics(source, "audio_vae", planning)
    packed = LTX2Pipeline._denormalize_audio_latents(LTX2Pipeline._pack_audio_latents(audio), mean, std)
    audio = LTX2Pipeline._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=audio.shape[3])
    return {**tensors, "latents": video, "audio_latents": audio}


def denoise_loop(source, request: Request, embeds, dtype, transformers, runtime, tp_mode, planning: bool = False):
    """LTX2Pipeline's loop as a DenoiseLoop over one tensor holding both streams' packed latents; `finish`
    de-normalises them with the VAEs' statistics (zeros and ones when `planning`: no values are read)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate
    from diffusers.utils.torch_utils import randn_tensor

    transformer = transformers["transformer"]
    config = dict(transformer.config)
    # The model's guidance, resolved on its folder's config: --plan also builds this loop for 2- and 3-block
    # copies (per-block collectives), which must run the same passes as the whole model.
    guidance = resolve_guidance(request, source.load_config("transformer"))
    for term, why in guidance.skipped.items():
        log(f"guidance: {term} skipped: {why}")
    frames, height, width = latent_grid(source, request)
    audio_length = audio_frames(source, request)
    audio_vae = source.load_config("audio_vae")
    mel_bins = audio_vae["mel_bins"] // audio_temporal_ratio(source)  # the VAE uses one factor for both
    patch, patch_t = config["patch_size"], config["patch_size_t"]

    generator = torch.Generator("cpu").manual_seed(request.seed)
    video = randn_tensor((1, config["in_channels"], frames, height, width), generator=generator, dtype=NOISE_DTYPE)
    image = embeds.get(IMAGE_LATENTS)
    if image is not None:  # image-to-video: the first latent frame starts from the image (prepare_latents)
        mask = torch.zeros(1, 1, frames, height, width)
        mask[:, :, 0] = 1.0
        video = image.float().repeat(1, 1, frames, 1, 1) * mask + video * (1 - mask)
    video = LTX2Pipeline._pack_latents(video, patch, patch_t)
    audio = randn_tensor((1, audio_vae["latent_channels"], audio_length, mel_bins), generator=generator)
    audio = LTX2Pipeline._pack_audio_latents(audio)
    shapes = (tuple(video.shape[1:]), tuple(audio.shape[1:]))

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(source.load_config("scheduler"))
    steps = request.num_inference_steps
    mu = calculate_shift(
        video.shape[1],
        scheduler.config.get("base_image_seq_len", 1024),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.95),
        scheduler.config.get("max_shift", 2.05),
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", None, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    fps = conditioning_frame_rate(float(request.fps), guidance.motion_speed)
    video_coords = transformer.rope.prepare_video_coords(1, frames, height, width, "cpu", fps=fps)
    audio_coords = transformer.audio_rope.prepare_audio_coords(1, audio_length, "cpu")
    tables = rope_tables(transformer, video_coords, audio_coords)
    geometry = (frames, height, width, fps, audio_length)
    guided = GuidedTransformer(transformer, guidance, dtype, shapes, geometry, runtime.constrain, i2v=image is not None)

    def rows(name: str) -> torch.Tensor:
        return torch.cat([embeds[("negative_" if b == "uncond" else "") + name] for b in guidance.branches])

    static = [(rows(name).to(dtype), BATCH) for name in STAGE1_TENSORS[:2]]
    static.append((rows("connector_attention_mask"), BATCH))
    kept = None
    if image is not None:
        first_frame = conditioning_mask(frames, height, width, patch, patch_t)  # (1, video tokens)
        static.append((first_frame, ()))
        kept = torch.zeros(video.numel() + audio.numel(), dtype=torch.bool)  # the first frame in the flat latents
        kept[: video.numel()] = first_frame[0].bool().repeat_interleave(video.shape[2])
    static += [(table.contiguous(), ()) for name in ROPES for table in tables[name]]

    def step(i, t, noise_pred, latents, carry):
        stepped = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        # Image-to-video: the pipeline steps every latent frame but the first (elementwise, so the same values).
        return (stepped if kept is None else torch.where(kept, latents, stepped)), carry

    def on_start(start, carry):
        scheduler.set_begin_index(start)  # the pipeline sets 0; --resume continues at `start`

    loop = DenoiseLoop(
        guided=(guided,),
        rules=transformer_rules(tp_mode),
        static_inputs=tuple(static),
        timesteps=timesteps,
        latents=torch.cat([video.flatten(1), audio.flatten(1)], dim=1),
        generator=generator,
        step=step,
        on_start=on_start,
        timestep_input=lambda i, t: torch.stack([t, scheduler.sigmas[i]]).float(),
        cache_branches=guidance.branches,
    )
    video_size = video[0].numel()

    def finish(latents):
        video_latents, audio_latents = latents[:, :video_size], latents[:, video_size:]
        video_latents = LTX2Pipeline._unpack_latents(
            video_latents.reshape(1, *shapes[0]), frames, height, width, patch, patch_t
        )
        audio_latents = LTX2Pipeline._unpack_audio_latents(
            audio_latents.reshape(1, *shapes[1]), audio_length, num_mel_bins=mel_bins
        )
        tensors = denormalized(source, {"latents": video_latents, "audio_latents": audio_latents}, planning)
        extra = {"guidance": guidance.record(), "audio_latents_layout": "BCLM"}
        return tensors, latents_record(scheduler, guidance.cfg, latents_normalization(source), **extra)

    return loop, finish


# Stage 3 -------------------------------------------------------------------------------------------


# Marks a stage-2 section whose latents stage 2 de-normalised itself. Sections without it (written before
# 2026-11-27) hold the latents as the transformer denoised them, normalised, though labelled "none": stage 2
# then read the statistics as zeros and ones in every real run, so de-normalising them now is exact.
DENORMALIZED = "vae_statistics_applied"


def latents_normalization(source) -> dict[str, Any]:
    """Stage 2's latents are already in the VAEs' spaces (the pipeline's output_type="latent")."""
    return {"method": "none", DENORMALIZED: True}


def upgrade_stage2(source, tensors: dict[str, torch.Tensor], normalization: dict[str, Any]):
    """Stage 3's view of a stage-2 section: one written before the fix (unmarked) is de-normalised here, with
    a log line, and then reads as a fixed one."""
    if normalization.get("method") != "none" or normalization.get(DENORMALIZED):
        return tensors, normalization
    log(
        "stage 2 of this folder predates 2026-11-27 and stored normalised LTX-2 latents: de-normalising them "
        "with the VAEs' statistics (exact; rerunning stage 2 writes them de-normalised)"
    )
    return denormalized(source, tensors), latents_normalization(source)


class Decoder(torch.nn.Module):
    """The video VAE's decode of stage 2's (already de-normalised) latents, as LTX2Pipeline decodes them.

    A VAE with timestep conditioning is decoded at the pipeline's default `decode_timestep` 0, whose noise
    scale (`decode_noise_scale`, defaulting to the timestep) is 0: the pipeline's noise draw then adds
    exactly nothing to the latents, so stage 3 need not draw it."""

    DECODE_TIMESTEP = 0.0

    def __init__(self, vae: torch.nn.Module, normalization: dict[str, Any]) -> None:
        super().__init__()
        if normalization.get("method") != "none" or not normalization.get(DENORMALIZED):
            raise UserError(f"LTX-2 latents are stored de-normalised; stage 2 recorded {normalization}")
        self.vae = vae

    def forward(self, latents):
        latents = latents.to(next(self.vae.parameters()).dtype)
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.full((latents.shape[0],), self.DECODE_TIMESTEP, dtype=latents.dtype, device=latents.device)
        return self.vae.decode(latents, timestep, return_dict=False)[0]


def video_processor(source):
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=vae_ratios(source)[0])
