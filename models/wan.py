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

Image-to-video: stage 1 runs the pipeline's own image conditioning (`encode_images`); each step the
guided transformer concatenates it to the latents on channels and feeds the CLIP tokens to both branches,
as the pipeline does.

Wan 2.2 TI2V-5B (`expand_timesteps`: a timestep per video token, the 48-channel VAE, an optional image):
models/wan_ti2v.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sharding import DP, SP
from utils import Request, UserError, log

from . import tiny, wan_ti2v, wan_vae
from .common import (
    NOISE_DTYPE,
    DeviceImageEncoder,
    DeviceTextEncoder,
    DeviceVAEEncoder,
    constrain_block_inputs,
    flow_scheduler,
    folder_flow_shift,
    size_from_request,
)
from .denoise import DenoiseLoop, latents_record, multistep_state, restore_multistep_state
from .family import Preset
from .guidance import BATCH, Guided, cfg_combination

NAME = "wan"
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
# Splash tiles: 512/512/512, the tiles measured to compile on v5e, v5p, v6e and tpu7x for head dim 128
# (benchmarks/tpu_plan.py --tiles); 720p/81 frames (75,600 tokens) pads by 0.23%, the 512-token
# prompt not at all.
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
LORA_LOADER = "WanLoraLoaderMixin"  # reads adapter files and converts the original Wan and musubi formats

# WanPipeline.__call__'s defaults (480p; the 14B models also run 720p: --height 720 --width 1280).
DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "fps": 16, "num_inference_steps": 50, "guidance_scale": 5.0}
MAX_SEQUENCE_LENGTH = 512  # the pipeline's prompt layout: valid tokens, then zeros up to 512

# Each block's positional inputs: video tokens (on sp between blocks), prompt tokens, its modulation
# (batch, 6, width), and the final norm's input: all unsplit along the width. Left free, the
# partitioner splits them over tp and all-gathers them again before the next linear (XLA:CPU, 2x1x4
# mesh: 3 all-gathers of the video tokens per block and 3 more outside; with the pins, none).
BLOCK_INPUTS = {0: (DP, SP, None), 1: (DP, None, None), 2: (DP, None, None)}


# Requests ------------------------------------------------------------------------------------------


def request_defaults(source) -> dict[str, Any]:
    """The pipeline's defaults; the flow shift as the folder's scheduler records it."""
    return {**DEFAULTS, "flow_shift": folder_flow_shift(source), **source.preset_defaults}


def transformer_components(source) -> tuple[str, ...]:
    """The transformers this pipeline runs: one, or Wan 2.2's two experts (high noise first)."""
    return ("transformer", "transformer_2") if source.index.get("boundary_ratio") is not None else ("transformer",)


def validate_request(source, request: Request) -> None:
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


def image_to_video(source) -> bool:
    return source.index.get("_class_name") == "WanImageToVideoPipeline"


def _pipeline(source, **components):
    """The source's pipeline (WanPipeline or WanImageToVideoPipeline) holding only the given components,
    with the source's VAE geometry."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    names = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer", "transformer_2")
    if image_to_video(source):
        names += ("image_encoder", "image_processor")
    pipe = (WanImageToVideoPipeline if image_to_video(source) else WanPipeline)(
        **{**dict.fromkeys(names), **components}
    )
    vae = source.load_config("vae")
    pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = (
        vae["scale_factor_spatial"],
        vae["scale_factor_temporal"],
    )
    return pipe


# Stage 1 -------------------------------------------------------------------------------------------


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """UMT5 loaded once; per request the pipeline's own `encode_prompt` (its cleaning, 512-token layout,
    trimming and zero padding) of the prompt and the negative prompt."""
    pipe = _pipeline(
        source,
        tokenizer=source.load("tokenizer"),
        text_encoder=DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime),
    )

    def encode(request: Request) -> dict[str, torch.Tensor]:
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

    return encode


def image_inputs(source) -> tuple[tuple[str, ...], bool]:
    """WanImageToVideoPipeline takes a first frame, and a last one where its transformer can use two: Wan
    2.2 A14B (no image embedder) or one with a position embedding for two images (FLF2V). Wan 2.1 I2V's
    embedder takes one image; diffusers 0.42.1 fails on a last frame there (image batch 2, text batch 1)."""
    if wan_ti2v.expand_timesteps(source):  # TI2V-5B: text-to-video, or image-to-video with --image
        return ("image",), False
    if not image_to_video(source):
        return (), False
    config = source.load_config("transformer")
    two = config.get("image_dim") is None or config.get("pos_embed_seq_len") is not None
    return (("image", "last_image") if two else ("image",)), True


image_size = size_from_request  # the pipeline resizes the image to the request's size


def encode_images(source, request: Request, images: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's image conditioning, computed by its own methods in float32 on the host (its example
    loads the VAE and image encoder in float32): the CLIP embeddings of the image(s) where the transformer
    has an image embedder (`image_embeds`), and `condition`: the first-frame mask and the normalised VAE
    latents of [image, zeros..., last image] (`prepare_latents`; its noise is drawn in stage 2). TI2V-5B:
    models/wan_ti2v.py."""
    if wan_ti2v.expand_timesteps(source):
        vae = DeviceVAEEncoder(source.load("vae", dtype=torch.float32).eval(), runtime)
        return wan_ti2v.encode_image(source, request, images["image"], vae)
    config = source.load_config("transformer")
    components = {"vae": source.load("vae", dtype=torch.float32).eval()}
    log(f"the condition video ({request.num_frames} frames) is VAE-encoded on the host CPU (as large as a decode)")
    if config.get("image_dim") is not None:
        encoder = source.load("image_encoder", dtype=torch.float32).eval()
        components["image_encoder"] = DeviceImageEncoder(encoder, runtime)
        components["image_processor"] = source.load("image_processor")
    pipe = _pipeline(source, **components)
    first, last = images["image"], images.get("last_image")
    for name, image in images.items():
        if abs(image.width / image.height - request.width / request.height) > 0.01:
            size = f"{request.width}x{request.height}"
            log(f"--{name}: {image.width}x{image.height} is resized to {size} as the pipeline does (new aspect ratio)")
    tensors = {}
    height, width, frames = request.height, request.width, request.num_frames
    with torch.no_grad():
        if "image_encoder" in components:
            tensors["image_embeds"] = pipe.encode_image(first if last is None else [first, last], "cpu")
        first, last = (
            None if image is None else pipe.video_processor.preprocess(image, height=height, width=width).float()
            for image in (first, last)
        )
        z_dim, spatial = source.load_config("vae")["z_dim"], pipe.vae_scale_factor_spatial
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        noise_shape = (1, z_dim, latent_frames, height // spatial, width // spatial)
        _, tensors["condition"] = pipe.prepare_latents(
            first, 1, z_dim, height, width, frames, torch.float32, "cpu", None, torch.zeros(noise_shape), last
        )
    return tensors


# Stage 2 -------------------------------------------------------------------------------------------


def transformer_rules(tp_mode: str):
    import sharding

    return sharding.wan_transformer_rules(tp_mode)


class GuidedTransformer(Guided):
    """One expert's denoiser evaluation: [cond, uncond] as one batch of 2 (on `dp`), where the pipeline
    makes two batch-1 calls, and its guidance expression with this expert's scale."""

    CFG_ORDER = ("cond", "uncond")

    def __init__(
        self, transformer, dtype, do_cfg: bool, guidance_scale: float, constrain=None, per_token=False
    ) -> None:
        super().__init__(transformer, do_cfg, constrain)
        self.dtype = dtype  # the pipeline's `transformer_dtype` (fp32-kept modules aside)
        self.guidance_scale = guidance_scale
        if constrain is not None:
            # per-token timesteps make each block's modulation (batch, tokens, 6, width), split like the tokens
            specs = {**BLOCK_INPUTS, 2: (DP, SP, None, None)} if per_token else BLOCK_INPUTS
            constrain_block_inputs([*transformer.blocks, transformer.norm_out], constrain, specs)

    def forward(self, latents, timestep, prompt_embeds, condition=None, image_embeds=None):
        """`condition` (image-to-video): the mask and image latents concatenated to the latents on channels,
        as the pipeline does before casting; `image_embeds`: the CLIP tokens, the same for both branches."""
        if condition is not None:  # one per video, or one for all (a batch of videos with the same image)
            condition = condition.expand(latents.shape[0], *condition.shape[1:])
        model_input = latents if condition is None else torch.cat([latents, condition], dim=1)

        def predict(model_input):
            # the CLIP tokens for both branches (a batch of videos: each video's, in the latents' order)
            images = (
                None if image_embeds is None else image_embeds.repeat(model_input.shape[0] // len(image_embeds), 1, 1)
            )
            return self.transformer(
                hidden_states=model_input,
                timestep=timestep.expand(model_input.shape[0], *timestep.shape[1:]),  # TI2V: (1, tokens)
                encoder_hidden_states=prompt_embeds,
                encoder_hidden_states_image=images,
                return_dict=False,
            )[0]

        combine = functools.partial(cfg_combination, guidance_scale=self.guidance_scale)
        return self.guided(model_input.to(self.dtype), predict, combine)


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model and request (to plan before encoding)."""
    transformer = source.load_config("transformer")
    shape = (1, MAX_SEQUENCE_LENGTH, transformer["text_dim"])
    embeds = {name: torch.zeros(shape, dtype=dtype) for name in ("prompt_embeds", "negative_prompt_embeds")}
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


def image_conditioning(source, embeds, dtype) -> list[tuple[torch.Tensor, tuple]]:
    """Stage 1's image conditioning as the guided transformer's extra inputs (`condition` in float32, cast
    with the latents as the pipeline does; `image_embeds` in the transformer's dtype), checked against the
    model: an image-to-video transformer needs them, a text-to-video one cannot take them."""
    if wan_ti2v.expand_timesteps(source):  # either task; the image's latents enter through wan_ti2v.loop_parts
        return []
    wants = image_to_video(source)
    if wants != ("condition" in embeds):
        have = "image conditioning (stage 1 had --image)" if "condition" in embeds else "no image conditioning"
        raise UserError(
            f"the stage-1 files hold {have}, but --model {source.ref!r} is "
            f"{'an image' if wants else 'a text'}-to-video model; rerun stage 1 for this model"
        )
    if not wants:
        return []
    inputs = [(embeds["condition"].float(), ())]
    if source.load_config("transformer").get("image_dim") is not None:
        inputs.append((embeds["image_embeds"].to(dtype), ()))
    return inputs


def boundary_timestep(source, scheduler) -> float | None:
    """Where Wan 2.2 switches experts (the pipeline's expression); None with one transformer."""
    ratio = source.index.get("boundary_ratio")
    return None if ratio is None else ratio * scheduler.config.num_train_timesteps


def denoise_loop(source, request: Request, embeds, dtype, transformers, runtime, tp_mode):
    """WanPipeline's (or WanImageToVideoPipeline's) loop as a DenoiseLoop over its experts, and the function
    giving stage 2's latents and record. Latents stay float32 between steps, as in the pipeline."""
    from diffusers import WanPipeline

    scheduler = flow_scheduler(source, request.flow_shift, request.scheduler)
    do_cfg = cfg_enabled(request.guidance_scale)
    scales = (
        request.guidance_scale,
        request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2,
    )
    names = transformer_components(source)
    per_token = wan_ti2v.expand_timesteps(source)
    guided = tuple(
        GuidedTransformer(transformers[name], dtype, do_cfg, scale, runtime.constrain, per_token)
        for name, scale in zip(names, scales, strict=False)
    )
    prompt_embeds = embeds["prompt_embeds"].to(dtype)
    if do_cfg:
        prompt_embeds = torch.cat([prompt_embeds, embeds["negative_prompt_embeds"].to(dtype)])
    generator = torch.Generator("cpu").manual_seed(request.seed)
    scheduler.set_timesteps(request.num_inference_steps, device="cpu")
    timesteps = scheduler.timesteps
    conditioning = image_conditioning(source, embeds, dtype)
    # WanPipeline's noise draw; the image-to-video pipeline draws the same, with the VAE's channel count
    # (its transformer's input adds the condition's channels).
    channels = source.load_config("vae")["z_dim"] if conditioning else transformers["transformer"].config.in_channels
    latents = WanPipeline.prepare_latents(
        _pipeline(source),
        1,
        channels,
        request.height,
        request.width,
        request.num_frames,
        NOISE_DTYPE,
        "cpu",
        generator,
    )
    boundary = boundary_timestep(source, scheduler)
    ti2v = wan_ti2v.loop_parts(source, embeds, latents) if per_token else {}

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
        static_inputs=((prompt_embeds, BATCH), *conditioning),
        timesteps=timesteps,
        latents=latents,
        generator=generator,
        step=step,
        on_start=on_start,
        expert_names=tuple(names),
        cache_branches=("cond", "uncond") if do_cfg else ("cond",),  # the pipeline's cache contexts
        **{key: ti2v[key] for key in ("timestep_input", "model_input") if key in ti2v},
    )
    switch = [i for i, t in enumerate(timesteps) if expert(i, t) == 1]
    if boundary is not None:
        where = f"from step {switch[0] + 1} of {len(timesteps)}" if switch else "never (the schedule stays above it)"
        log(f"two experts: transformer_2 takes over at timesteps below {boundary:g}, {where}")
    extra = {"experts": list(names), "boundary_timestep": boundary, "expert_2_from_step": switch[0] if switch else None}

    def finish(latents):
        latents = ti2v["finish"](latents) if ti2v else latents
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


CHUNK_FRAMES, frame_programs, frame_plan = wan_vae.CHUNK_FRAMES, wan_vae.frame_programs, wan_vae.frame_plan


def video_processor(source):
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=source.load_config("vae")["scale_factor_spatial"])


# Tiny presets (models/tiny.py builds them) ---------------------------------------------------------

TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 16, "num_inference_steps": 6}
PRESETS = {
    "tiny-wan2.1": Preset(NAME, functools.partial(tiny.wan, "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2": Preset(NAME, functools.partial(tiny.wan, "2.2"), TINY_DEFAULTS),
    "tiny-wan2.1-i2v": Preset(NAME, functools.partial(tiny.wan_i2v, "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2-i2v": Preset(NAME, functools.partial(tiny.wan_i2v, "2.2"), TINY_DEFAULTS),
    # TI2V-5B's layout; sizes are multiples of 32 (16x VAE, 2x2 patches)
    "tiny-wan2.2-ti2v": Preset(NAME, tiny.wan_ti2v, {**TINY_DEFAULTS, "height": 64, "width": 96}),
}
