"""CogVideoX 1.0 and 1.5 (diffusers `CogVideoXPipeline`, and `CogVideoXImageToVideoPipeline` through
models/cogvideox_i2v.py): defaults, validation, the three stage bodies.

The math stays in diffusers: prompt encoding, initial noise, rotary embeddings, the scheduler and the
VAE post-processing are the pipeline's own methods, called on a pipeline object that holds only the
components a stage has loaded. What is ours is the cut into stages and the transformer call, which
stage 2 hands to a runtime (torchax on a JAX device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from sharding import DP, SP
from utils import Request, UserError

from . import cogvideox_i2v, cogvideox_vae, tiny
from .common import (
    NOISE_DTYPE,
    DeviceTextEncoder,
    constrain_block_inputs,
    one_transformer,
    recorded_scaling_factor,
    refuse_wan_extras,
    size_from_request,
    vae_scaling_factor,
)
from .denoise import DenoiseLoop, latents_record
from .family import Preset
from .guidance import BATCH, Guided, cfg_combination

NAME = "cogvideox"
PIPELINE_CLASSES = ("CogVideoXPipeline", cogvideox_i2v.PIPELINE_CLASS)

# Documented per-variant defaults (model cards). The pipeline's own fallback (transformer
# sample_height x 8) would give 2400x2400 for CogVideoX1.5, whose config says sample_height=300.
VARIANT_DEFAULTS = {
    "1.0": {"height": 480, "width": 720, "num_frames": 49, "fps": 8},
    "1.5": {"height": 768, "width": 1360, "num_frames": 81, "fps": 16},
}
COMMON_DEFAULTS = {"num_inference_steps": 50, "guidance_scale": 6.0}

# Splash tiles. The reference notes measured 3328/2816/256 fastest for CogVideoX1.5 at 768x1360 on v6e
# (speed is not measurable without a TPU). The TPU compiler (benchmarks/tpu_plan.py) shows it compiles
# on v6e-8 and tpu7x-8 and pads 45,106 tokens by 3.2% (queries) and 5.8% (keys); it overflows the 16 MiB
# of scoped VMEM on v5e and v5p, where stage 2 uses tpus.Generation.splash_tile_cap instead.
SPLASH_BLOCK_SIZES = {"block_q": 3328, "block_kv": 2816, "block_kv_compute": 256}
LORA_LOADER = "CogVideoXLoraLoaderMixin"  # reads adapters; load_lora_adapter converts older diffusers keys
# stage 3 on torchax: the stock decode's frame batches, one program call each (models/cogvideox_vae.py)
CHUNK_FRAMES, frame_programs, frame_plan = (
    cogvideox_vae.CHUNK_FRAMES,
    cogvideox_vae.frame_programs,
    cogvideox_vae.frame_plan,
)


def variant(transformer_config: dict[str, Any]) -> str:
    """CogVideoX 1.5 patches time (patch_size_t); 1.0 does not."""
    return "1.0" if transformer_config.get("patch_size_t") is None else "1.5"


def request_defaults(source) -> dict[str, Any]:
    version = variant(source.load_config("transformer"))
    return {**VARIANT_DEFAULTS[version], **COMMON_DEFAULTS, **source.preset_defaults, "variant": version}


@dataclass(frozen=True)
class Geometry:
    """How pixels map to latents and tokens for one model."""

    spatial: int  # VAE downsampling of height and width
    temporal: int  # VAE downsampling of frames
    patch: int
    patch_t: int | None
    text_tokens: int

    @classmethod
    def of(cls, source) -> Geometry:
        transformer = source.load_config("transformer")
        vae = source.load_config("vae")
        return cls(
            spatial=2 ** (len(vae["block_out_channels"]) - 1),
            temporal=vae["temporal_compression_ratio"],
            patch=transformer["patch_size"],
            patch_t=transformer.get("patch_size_t"),
            text_tokens=transformer["max_text_seq_length"],
        )


def validate_request(source, request: Request) -> None:
    """Reject what the VAE, the patching or the positional embeddings cannot take, before loading weights."""
    refuse_wan_extras(request)
    geometry = Geometry.of(source)
    size_step = geometry.spatial * geometry.patch
    for key in ("height", "width"):
        value = getattr(request, key)
        if value <= 0 or value % size_step:
            raise UserError(
                f"--{key} {value} must be a positive multiple of {size_step} "
                f"(VAE downsampling {geometry.spatial} x patch size {geometry.patch})"
            )
    frames = request.num_frames
    # The VAE turns k latent frames into 4(k-1)+1 frames only when k is odd (an even k decodes to 4k),
    # so the frame counts that round-trip are 8n+1; (F-1)/4+1 is the latent frame count.
    frame_step = 2 * geometry.temporal
    if frames < 1 or (frames - 1) % frame_step:
        raise UserError(
            f"--num_frames {frames} must be {frame_step}n+1 (e.g. 49 or 81): the VAE compresses time by "
            f"{geometry.temporal} and decodes only an odd number of latent frames back to that count"
        )
    transformer = source.load_config("transformer")
    if transformer.get("use_learned_positional_embeddings"):
        expected = (
            transformer["sample_height"] * geometry.spatial,
            transformer["sample_width"] * geometry.spatial,
            transformer["sample_frames"],
        )
        if (request.height, request.width, frames) != expected:
            raise UserError(
                "this model has learned positional embeddings and only takes "
                f"--height {expected[0]} --width {expected[1]} --num_frames {expected[2]}"
            )
    if request.flow_shift is not None:
        raise UserError("--flow_shift applies to flow-matching models (HunyuanVideo-1.5), not CogVideoX")


def _pipeline(**components):
    """A CogVideoXPipeline holding only the given components, so its helper methods can be reused."""
    from diffusers import CogVideoXPipeline

    parts = dict.fromkeys(("tokenizer", "text_encoder", "vae", "transformer", "scheduler"))
    parts.update(components)
    return CogVideoXPipeline(**parts)


# Stage 1 -------------------------------------------------------------------------------------------


image_inputs = cogvideox_i2v.image_inputs
encode_images = cogvideox_i2v.encode_images
image_size = size_from_request  # the pipeline resizes the image to the request's size


def prompt_encoder(source, dtype: torch.dtype, runtime):
    """T5 loaded once; per request the embeddings of the prompt and negative prompt, padded to the
    transformer's text length."""
    text_encoder = DeviceTextEncoder(source.load("text_encoder", dtype=dtype).eval(), runtime)
    pipe = _pipeline(tokenizer=source.load("tokenizer"), text_encoder=text_encoder)

    def encode(request: Request) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
                request.prompt,
                request.negative_prompt,
                do_classifier_free_guidance=True,  # always encode the negative: stage 2 may turn CFG on
                max_sequence_length=Geometry.of(source).text_tokens,
                device=runtime.device,
                dtype=dtype,
            )
        return {"prompt_embeds": prompt_embeds.cpu(), "negative_prompt_embeds": negative_prompt_embeds.cpu()}

    return encode


# Stage 2 -------------------------------------------------------------------------------------------


def rotary_attention_processor():
    """diffusers' CogVideoXAttnProcessor2_0 with the rotary embedding applied by concatenation.

    The stock processor writes the rotated video tokens back in place (`query[:, :, T:] = ...`). Under
    jit on XLA:CPU that scatter gives wrong results (1e-2 relative error at batch 1 with no sharding,
    and under `dp` sharding at batch 2; batch 2 unsharded is fine). Building the tensor with torch.cat
    is the same math and compiles correctly everywhere. tests/test_cogvideox_patches.py proves the two
    processors agree in eager PyTorch.
    """
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
    from diffusers.models.embeddings import apply_rotary_emb

    class CatRotaryCogVideoXAttnProcessor(CogVideoXAttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
            if attention_mask is not None:  # CogVideoX never passes one; keep the stock path for it
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            text_len = encoder_hidden_states.size(1)
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            batch_size = hidden_states.shape[0]

            def heads(projection, norm):
                tensor = projection(hidden_states)
                tensor = tensor.view(batch_size, -1, attn.heads, tensor.shape[-1] // attn.heads).transpose(1, 2)
                return norm(tensor) if norm is not None else tensor

            query, key, value = heads(attn.to_q, attn.norm_q), heads(attn.to_k, attn.norm_k), heads(attn.to_v, None)
            if image_rotary_emb is not None:

                def rotate(tensor):
                    rotated = apply_rotary_emb(tensor[:, :, text_len:], image_rotary_emb)
                    return torch.cat([tensor[:, :, :text_len], rotated], dim=2)

                query = rotate(query)
                if not attn.is_cross_attention:
                    key = rotate(key)

            hidden_states = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False
            )
            hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * query.shape[-1])
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            encoder_hidden_states, hidden_states = hidden_states.split(
                [text_len, hidden_states.size(1) - text_len], dim=1
            )
            return hidden_states, encoder_hidden_states

    return CatRotaryCogVideoXAttnProcessor()


def make_jit_safe(transformer: torch.nn.Module) -> torch.nn.Module:
    """The one place CogVideoX's transformer is adapted for jit (see rotary_attention_processor)."""
    transformer.set_attn_processor(rotary_attention_processor())
    return transformer


# Activation layouts on the mesh (mesh axis per dimension): the CFG batch on dp, video tokens on sp
# between blocks.
BLOCK_INPUTS = {"hidden_states": (DP, SP, None), "encoder_hidden_states": (DP, None, None)}


def cfg_enabled(guidance_scale: float) -> bool:
    """CogVideoXPipeline runs the unconditional branch only for a guidance scale above 1."""
    return guidance_scale > 1.0


def transformer_rules(tp_mode: str):
    import sharding

    return sharding.cogvideox_transformer_rules(tp_mode)


class GuidedTransformer(Guided):
    """One denoiser evaluation: the transformer on [uncond, cond] and the CFG combination, as one graph.

    Mirrors CogVideoXPipeline.__call__'s loop body; the guidance scale is a tensor so dynamic CFG
    would not recompile. `constrain(tensor, spec)` pins activation layouts on the runtime's mesh.
    """

    CFG_ORDER = ("uncond", "cond")

    def __init__(self, transformer: torch.nn.Module, do_cfg: bool, constrain=None) -> None:
        super().__init__(transformer, do_cfg, constrain)
        if constrain is not None:
            constrain_block_inputs(transformer.transformer_blocks, constrain, BLOCK_INPUTS)

    def forward(self, latents, timestep, prompt_embeds, image_rotary_emb, guidance_scale, image_latents=None, ofs=None):
        """Image-to-video: `image_latents` join the (scaled) latents on channels, and `ofs` goes to the
        transformer as is, as CogVideoXImageToVideoPipeline does."""
        if image_latents is not None:  # one per video, or one for all (a batch of videos with the same image)
            image_latents = image_latents.expand(latents.shape[0], *image_latents.shape[1:])
        model_input = latents if image_latents is None else torch.cat([latents, image_latents], dim=2)

        def predict(model_input):
            return self.transformer(
                hidden_states=model_input,
                encoder_hidden_states=prompt_embeds,
                timestep=timestep.expand(model_input.shape[0]),
                ofs=ofs,
                image_rotary_emb=image_rotary_emb,
                return_dict=False,
            )[0].float()

        return self.guided(model_input, predict, functools.partial(cfg_combination, guidance_scale=guidance_scale))


def planning_embeds(source, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero stage-1 tensors of the shapes stage 1 writes for this model (to plan before encoding)."""
    transformer = source.load_config("transformer")
    shape = (1, transformer["max_text_seq_length"], transformer["text_embed_dim"])
    embeds = {name: torch.zeros(shape, dtype=dtype) for name in ("prompt_embeds", "negative_prompt_embeds")}
    if cogvideox_i2v.image_to_video(source):
        embeds.update(cogvideox_i2v.planning_embeds(source, request, dtype))
    return embeds


transformer_components = one_transformer
latents_normalization = vae_scaling_factor


def denoise_loop(source, request: Request, embeds: dict[str, torch.Tensor], dtype, transformers, runtime, tp_mode):
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
    image_inputs = []
    if cogvideox_i2v.image_to_video(source):  # the image sample, then the noise, in the pipeline's dtype
        latents, image_latents = cogvideox_i2v.noise_and_image_latents(
            source, request, embeds, transformer, scheduler, num_frames, generator, dtype
        )
        image_inputs = cogvideox_i2v.extra_inputs(source, image_latents, dtype)
    else:
        channels = transformer.config.in_channels
        args = (num_frames, request.height, request.width, NOISE_DTYPE, "cpu", generator)
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
    )

    def finish(latents):
        latents = latents[:, pad_frames:].permute(0, 2, 1, 3, 4).contiguous()
        return latents, latents_record(
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


# Tiny presets (models/tiny.py builds them) ---------------------------------------------------------

TINY_DEFAULTS = {"height": 64, "width": 96, "num_frames": 9, "fps": 8, "num_inference_steps": 8}
PRESETS = {
    "tiny-cogvideox": Preset(NAME, functools.partial(tiny.cogvideox, "1.5"), TINY_DEFAULTS),
    "tiny-cogvideox1.0": Preset(NAME, functools.partial(tiny.cogvideox, "1.0"), TINY_DEFAULTS),
    "tiny-cogvideox-i2v": Preset(NAME, functools.partial(tiny.cogvideox, "1.5", image_to_video=True), TINY_DEFAULTS),
    "tiny-cogvideox1.0-i2v": Preset(NAME, functools.partial(tiny.cogvideox, "1.0", image_to_video=True), TINY_DEFAULTS),
}
