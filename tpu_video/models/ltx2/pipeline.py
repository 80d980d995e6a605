"""LTX-2 (diffusers `LTX2Pipeline`): a video and an audio stream denoised together by one transformer.

Stage 1 runs the pipeline's own prompt encoding with Gemma 3 (LTX-2.5: Gemma 4; left padding to 1024 tokens,
every hidden state stacked) and its text connectors, and writes each prompt's connector outputs: the video and
audio streams' text tokens and their mask. Stage 2 draws the noise as the pipeline does (video first, then audio), runs
every guidance pass of a step as one compiled batch (transformer.py) and steps both streams with one
FlowMatch Euler scheduler; it writes both latents as the pipeline returns them with `output_type="latent"`:
unpacked and de-normalised to their VAEs' spaces, so nothing is left for stage 3 to undo.
"""

from __future__ import annotations

import torch

from tpu_video.cli import log
from tpu_video.engine.denoise import NOISE_DTYPE, DenoiseLoop, latents_record
from tpu_video.engine.encoders import DeviceTextEncoder
from tpu_video.engine.guidance import BATCH
from utils import Request

from .conditions import condition_count, conditioned_video, noise_scale, planning_conditions
from .config import (
    MAX_SEQUENCE_LENGTH,
    audio_frames,
    audio_temporal_ratio,
    image_to_video,
    latent_grid,
    schedule_sigmas,
    scheduler_config,
    stock_pipeline,
)
from .connectors import DeviceConnectors
from .guidance import resolve_guidance
from .i2v import IMAGE_LATENTS, conditioning_mask
from .latents import denormalized, latents_normalization, normalized, vae_statistics
from .transformer import ROPES, GuidedTransformer, rope_tables, transformer_rules

STAGE1_TENSORS = ("connector_prompt_embeds", "connector_audio_prompt_embeds", "connector_attention_mask")

# Stage 1 -------------------------------------------------------------------------------------------


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """Gemma 3 or 4 (its language model) and the connectors loaded once, both on the runtime; per request the
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
    _, height, width = latent_grid(source, request)
    if image_to_video(source):
        embeds[IMAGE_LATENTS] = torch.zeros(1, transformer["in_channels"], 1, height, width)
    return {**embeds, **planning_conditions(request, transformer["in_channels"], height, width)}


def denoise_loop(source, request: Request, embeds, dtype, transformers, runtime, tp_mode, *, planning: bool):
    """LTX2Pipeline's loop as a DenoiseLoop over one tensor holding both streams' packed latents; `finish`
    de-normalises them with the VAEs' statistics, read here before the loop runs (zeros and ones when
    `planning`: no values are read)."""
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
    statistics = vae_statistics(source, planning)
    for term, why in guidance.skipped.items():
        log(f"guidance: {term} skipped: {why}")
    frames, height, width = latent_grid(source, request)
    audio_length = audio_frames(source, request)
    audio_vae = source.load_config("audio_vae")
    mel_bins = audio_vae["mel_bins"] // audio_temporal_ratio(source)  # the VAE uses one factor for both
    patch, patch_t = config["patch_size"], config["patch_size_t"]

    generator = torch.Generator("cpu").manual_seed(request.seed)
    fps = conditioning_frame_rate(float(request.fps), guidance.motion_speed)
    image = embeds.get(IMAGE_LATENTS)
    conditioned = conditioned_video(source, request, embeds, config, fps, generator)
    if conditioned is not None:  # LTX2ConditionPipeline: packed draws, keyframe tokens after the video's
        log(f"conditions: {conditioned.placed}")
        video, video_tokens = conditioned.latents, conditioned.video_tokens
        audio = randn_tensor((1, audio_length, audio_vae["latent_channels"] * mel_bins), generator=generator)
    else:
        video = randn_tensor((1, config["in_channels"], frames, height, width), generator=generator, dtype=NOISE_DTYPE)
        # Image-to-video: the first latent frame starts from the image (prepare_latents). A pass from given
        # latents (start_from replaces these) may run at another size than the image was encoded for: not
        # combined then.
        if image is not None and image.shape[-2:] == video.shape[-2:]:
            mask = torch.zeros(1, 1, frames, height, width)
            mask[:, :, 0] = 1.0
            video = image.float().repeat(1, 1, frames, 1, 1) * mask + video * (1 - mask)
        video = LTX2Pipeline._pack_latents(video, patch, patch_t)
        video_tokens = video.shape[1]
        audio = randn_tensor((1, audio_vae["latent_channels"], audio_length, mel_bins), generator=generator)
        audio = LTX2Pipeline._pack_audio_latents(audio)
    shapes = (tuple(video.shape[1:]), tuple(audio.shape[1:]))

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config(source, request))
    steps = request.num_inference_steps
    mu = calculate_shift(
        video.shape[1],
        scheduler.config.get("base_image_seq_len", 1024),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.95),
        scheduler.config.get("max_shift", 2.05),
    )
    sigmas = schedule_sigmas(request) or np.linspace(1.0, 1 / steps, steps)  # the pipeline's rule
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", None, sigmas=sigmas, mu=mu)

    video_coords = transformer.rope.prepare_video_coords(1, frames, height, width, "cpu", fps=fps)
    if conditioned is not None and conditioned.keyframe_coords is not None:
        video_coords = torch.cat([video_coords, conditioned.keyframe_coords], dim=2)
    audio_coords = transformer.audio_rope.prepare_audio_coords(1, audio_length, "cpu")
    tables = rope_tables(transformer, video_coords, audio_coords)
    geometry = (frames, height, width, fps, audio_length)
    conditioning = "blend" if conditioned is not None else "first_frame" if image is not None else None
    guided = GuidedTransformer(transformer, guidance, dtype, shapes, geometry, runtime.constrain, conditioning)

    def rows(name: str) -> torch.Tensor:
        return torch.cat([embeds[("negative_" if b == "uncond" else "") + name] for b in guidance.branches])

    static = [(rows(name).to(dtype), BATCH) for name in STAGE1_TENSORS[:2]]
    static.append((rows("connector_attention_mask"), BATCH))
    kept = None
    if conditioned is not None:  # per token: its strength, and the clean latents it is held to
        static += [(conditioned.mask, ()), (conditioned.clean, ())]
    elif image is not None:
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
        video_latents = video_latents.reshape(1, *shapes[0])[:, :video_tokens]  # without keyframe tokens
        video_latents = LTX2Pipeline._unpack_latents(video_latents, frames, height, width, patch, patch_t)
        audio_latents = LTX2Pipeline._unpack_audio_latents(
            audio_latents.reshape(1, *shapes[1]), audio_length, num_mel_bins=mel_bins
        )
        tensors = denormalized({"latents": video_latents, "audio_latents": audio_latents}, statistics)
        extra = {"guidance": guidance.record(), "audio_latents_layout": "BCLM"}
        return tensors, latents_record(scheduler, guidance.cfg, latents_normalization(source), **extra)

    return loop, finish


def start_from(source, request: Request, tensors: dict[str, torch.Tensor], embeds) -> torch.Tensor:
    """A pass from an earlier one's stage-2 latents (both streams), as the pipeline called with `latents=` and
    `audio_latents=` starts: each normalised, then `noise_scale * noise + (1 - noise_scale) * latents`
    (_create_noised_state) with the noise drawn from the request's seed, the video's first. LTX2Pipeline
    renoises the packed video; LTX2ImageToVideoPipeline the unpacked one, with no noise on the first frame (its
    conditioning mask), which the loop then keeps. A noise scale of 0 leaves both exactly as given. A conditioned
    video (stage 1's --condition) starts as LTX2ConditionPipeline does: the conditions applied to the given
    latents and the noise scaled around them, its noise scale defaulting to the schedule's first sigma."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

    config = source.load_config("transformer")
    patch = (config["patch_size"], config["patch_size_t"])
    video, audio = normalized(tensors, vae_statistics(source, planning=False))
    generator = torch.Generator("cpu").manual_seed(request.seed)
    if condition_count(embeds):
        fps = conditioning_frame_rate(float(request.fps), resolve_guidance(request, config).motion_speed)
        video = conditioned_video(source, request, embeds, config, fps, generator, given=video).latents
        scale = noise_scale(request, given=True)
    else:
        scale = request.option("noise_scale") or 0.0
        if scale and image_to_video(source):
            kept = torch.zeros_like(video[:, :1])
            kept[:, :, 0] = 1.0
            video = LTX2Pipeline._create_noised_state(video, scale * (1 - kept), generator)
        video = LTX2Pipeline._pack_latents(video, *patch)
        if scale and not image_to_video(source):
            video = LTX2Pipeline._create_noised_state(video, scale, generator)
    if scale:  # drawn after the video's noise; at 0 the pipeline's draw changes nothing
        audio = LTX2Pipeline._create_noised_state(audio, scale, generator)
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
