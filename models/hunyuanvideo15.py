"""HunyuanVideo-1.5 (diffusers `HunyuanVideo15Pipeline`, and `HunyuanVideo15ImageToVideoPipeline` through
hunyuanvideo15_i2v): its request rules, prompt encoding, denoise loop, and the transformer made traceable.

Two spots of `HunyuanVideo15Transformer3DModel.forward` cannot be traced by jax.jit:
- `if torch.all(image_embeds == 0)` branches on tensor values (ConcretizationTypeError). Text-to-video
  always passes zero image embeddings, so the branch is a Python argument here (`text_to_video`).
- The text-token reorder (valid image, ByT5 and Qwen tokens first, then the padding, per sample)
  indexes with boolean masks, whose result shape depends on the values. A stable argsort of the
  concatenated validity mask gives the same order with static shapes, and a gather applies it.

The VAE's attention builds its frame-causal mask with a Python loop over every token (64 s to trace
at 2048 tokens, measured here); `hunyuanvideo15_vae.frame_causal_mask` builds the identical mask from a
comparison of frame indices.

Attention: the stock processor expands the text mask to a dense (B, 1, S, S) `valid_i & valid_j` mask
for every block, S x S work at S ~ 112k tokens (720p). `key_mask_attention_processor` passes the
per-key mask (B, 1, 1, S) instead. Padded text queries then attend to the valid keys rather than to
nothing; no valid token ever reads a padded one (they are masked as keys), so the video output is
unchanged, which the tests check. Only the token refiner (1000 text tokens) still builds its dense
per-head mask, which the Splash override reduces to per-key and per-query vectors.

`traceable_forward` is the stock forward with only the two untraceable spots rewritten (same
submodules, same order of operations); tests/test_hunyuanvideo15_patches.py holds it, and the key-mask
processor, equal to the stock ones in eager PyTorch.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Any

import torch

from utils import Request, UserError

from . import common, hunyuanvideo15_i2v, hunyuanvideo15_vae, tiny
from .common import NOISE_DTYPE, DeviceTextEncoder
from .denoise import DenoiseLoop, latents_record
from .family import Preset
from .guidance import BATCH, Guided

NAME = "hunyuanvideo15"
PIPELINE_CLASSES = ("HunyuanVideo15Pipeline", hunyuanvideo15_i2v.PIPELINE_CLASS)
# Splash tiles: 512/512/512 compiles on v5e, v5p, v6e and tpu7x (TPU compiler, benchmarks/tpu_plan.py)
# and pads the 720p/121-frame sequence (113,585 tokens) by 0.07%; the reference notes' 2048/2048 pads
# 0.97% and does not fit v5e/v5p's scoped VMEM. Which is faster is unmeasured (no TPU here).
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
LORA_LOADER = None  # diffusers 0.42.1 has no loader for 1.5: files must hold diffusers/PEFT keys
# stage 3 on torchax: chunks of any length (models/hunyuanvideo15_vae.py restructures the decoder's forward)
CHUNK_FRAMES = hunyuanvideo15_vae.CHUNK_FRAMES
frame_programs, frame_plan = hunyuanvideo15_vae.frame_programs, hunyuanvideo15_vae.frame_plan

# The pipeline's documented text-to-video defaults; the transformer's `target_size` says 480p or 720p.
RESOLUTION_DEFAULTS = {
    640: {"height": 480, "width": 848, "flow_shift": 5.0},
    960: {"height": 720, "width": 1280, "flow_shift": 9.0},
}
COMMON_DEFAULTS = {"num_frames": 121, "fps": 24, "num_inference_steps": 50, "guidance_scale": 6.0}

# Activation layout (mesh axis per dimension): the CFG batch on dp.
PROMPT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


def reorder_text_tokens(states: list[torch.Tensor], masks: list[torch.Tensor]):
    """Concatenate token groups and move each sample's valid tokens first, keeping their order.

    `states` (B, S_i, D) and boolean `masks` (B, S_i) in concatenation order. Invalid tokens of every
    group but the first are zeroed, as the stock forward does for the ByT5 and Qwen padding.
    """
    zeroed = [states[0]] + [
        torch.where(mask[..., None], state, torch.zeros_like(state))
        for state, mask in zip(states[1:], masks[1:], strict=True)
    ]
    hidden = torch.cat(zeroed, dim=1)
    mask = torch.cat(masks, dim=1)
    order = torch.argsort((~mask).to(torch.int32), dim=1, stable=True)
    # torch.gather, not take_along_dim: under torchax the indices are int32 (no x64), which
    # take_along_dim's dtype check rejects.
    hidden = torch.gather(hidden, 1, order[..., None].expand(-1, -1, hidden.shape[-1]))
    return hidden, torch.gather(mask, 1, order)


def traceable_forward(
    self,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    timestep_r: torch.LongTensor | None = None,
    encoder_hidden_states_2: torch.Tensor | None = None,
    encoder_attention_mask_2: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    attention_kwargs=None,
    return_dict: bool = True,
    text_to_video: bool = True,
):
    """HunyuanVideo15Transformer3DModel.forward (diffusers 0.42.1) without value-dependent control flow."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size_t, self.config.patch_size, self.config.patch_size
    post_patch_num_frames, post_patch_height, post_patch_width = num_frames // p_t, height // p_h, width // p_w

    image_rotary_emb = self.rope(hidden_states)
    temb = self.time_embed(timestep, timestep_r=timestep_r)
    hidden_states = self.x_embedder(hidden_states)

    encoder_hidden_states = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
    encoder_hidden_states = encoder_hidden_states + self.cond_type_embed(
        torch.zeros_like(encoder_hidden_states[:, :, 0], dtype=torch.long)
    )
    encoder_hidden_states_2 = self.context_embedder_2(encoder_hidden_states_2)
    encoder_hidden_states_2 = encoder_hidden_states_2 + self.cond_type_embed(
        torch.ones_like(encoder_hidden_states_2[:, :, 0], dtype=torch.long)
    )
    encoder_hidden_states_3 = self.image_embedder(image_embeds)
    mask_3 = torch.full(
        (batch_size, encoder_hidden_states_3.shape[1]),
        0 if text_to_video else 1,
        dtype=encoder_attention_mask.dtype,
        device=encoder_attention_mask.device,
    )
    if text_to_video:  # a Python flag where the stock forward tests `torch.all(image_embeds == 0)`
        encoder_hidden_states_3 = encoder_hidden_states_3 * 0.0
    encoder_hidden_states_3 = encoder_hidden_states_3 + self.cond_type_embed(
        2 * torch.ones_like(encoder_hidden_states_3[:, :, 0], dtype=torch.long)
    )

    encoder_hidden_states, encoder_attention_mask = reorder_text_tokens(
        [encoder_hidden_states_3, encoder_hidden_states_2, encoder_hidden_states],
        [mask_3.bool(), encoder_attention_mask_2.bool(), encoder_attention_mask.bool()],
    )

    for block in self.transformer_blocks:
        hidden_states, encoder_hidden_states = block(
            hidden_states, encoder_hidden_states, temb, encoder_attention_mask, image_rotary_emb
        )

    hidden_states = self.norm_out(hidden_states, temb)
    hidden_states = self.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, -1, p_t, p_h, p_w
    )
    hidden_states = hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7)
    hidden_states = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    if not return_dict:
        return (hidden_states,)
    return Transformer2DModelOutput(sample=hidden_states)


def key_mask_attention_processor():
    """HunyuanVideo15AttnProcessor2_0 (diffusers 0.42.1) passing a per-key mask instead of the dense one."""
    import torch.nn.functional as F
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    class KeyMaskHunyuanVideo15AttnProcessor(HunyuanVideo15AttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
            query = attn.norm_q(attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)))
            key = attn.norm_k(attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)))
            value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
            if image_rotary_emb is not None:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            if encoder_hidden_states is not None:
                encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                if attn.norm_added_q is not None:
                    encoder_query = attn.norm_added_q(encoder_query)
                if attn.norm_added_k is not None:
                    encoder_key = attn.norm_added_k(encoder_key)
                query = torch.cat([query, encoder_query], dim=1)
                key = torch.cat([key, encoder_key], dim=1)
                value = torch.cat([value, encoder_value], dim=1)

            # The only change: video tokens are always valid keys, text tokens per the mask; no S x S mask.
            seq_len = query.shape[1]
            key_valid = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=key_valid[:, None, None, :],
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
            if encoder_hidden_states is not None:
                text_len = encoder_hidden_states.shape[1]
                hidden_states, encoder_hidden_states = hidden_states[:, :-text_len], hidden_states[:, -text_len:]
                if getattr(attn, "to_out", None) is not None:
                    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
                if getattr(attn, "to_add_out", None) is not None:
                    encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
            return hidden_states, encoder_hidden_states

    return KeyMaskHunyuanVideo15AttnProcessor()


def make_jit_safe(transformer: torch.nn.Module) -> torch.nn.Module:
    """The one place HunyuanVideo-1.5's transformer is adapted for jit (see the module docstring)."""
    transformer.forward = types.MethodType(traceable_forward, transformer)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(key_mask_attention_processor())
    return transformer


# Requests ------------------------------------------------------------------------------------------


def request_defaults(source) -> dict[str, Any]:
    target = source.load_config("transformer").get("target_size", 640)
    resolution = RESOLUTION_DEFAULTS.get(target, RESOLUTION_DEFAULTS[640])
    guidance = source.load_config("guider").get("guidance_scale", COMMON_DEFAULTS["guidance_scale"])
    if hunyuanvideo15_i2v.image_to_video(source):  # its folders' shift (720p: 7.0, not t2v's 9.0); size from the image
        resolution = {**resolution, "flow_shift": common.folder_flow_shift(source)}
    return {**COMMON_DEFAULTS, **resolution, "guidance_scale": guidance, **source.preset_defaults}


@dataclass(frozen=True)
class Geometry:
    spatial: int
    temporal: int
    latent_channels: int

    @classmethod
    def of(cls, source) -> Geometry:
        vae = source.load_config("vae")
        return cls(
            spatial=vae["spatial_compression_ratio"],
            temporal=vae["temporal_compression_ratio"],
            latent_channels=vae["latent_channels"],
        )


def validate_request(source, request: Request) -> None:
    common.refuse_wan_extras(request)
    geometry = Geometry.of(source)
    for key in ("height", "width"):
        value = getattr(request, key)
        if value <= 0 or value % geometry.spatial:
            raise UserError(f"--{key} {value} must be a positive multiple of {geometry.spatial}")
    frames = request.num_frames
    if frames < 1 or (frames - 1) % geometry.temporal:
        raise UserError(f"--num_frames {frames} must be {geometry.temporal}n+1 (e.g. 121)")
    if request.flow_shift is None or request.flow_shift <= 0:
        raise UserError(f"--flow_shift {request.flow_shift} must be positive")
    guider = source.load_config("guider")
    if (guider.get("start", 0.0), guider.get("stop", 1.0)) != (0.0, 1.0):
        raise UserError("this model's guider limits CFG to part of the schedule (start/stop); not supported yet")


def _pipeline(source=None, **components):
    """A HunyuanVideo15Pipeline holding only the given components, so its helper methods can be reused.

    Its constructor reads the VAE's config, so without a real VAE it gets one built from `source`'s VAE
    config on the meta device (no weights, no memory)."""
    from diffusers import HunyuanVideo15Pipeline

    names = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler", "text_encoder_2", "tokenizer_2", "guider")
    if "vae" not in components:
        cls = source.component_class("vae")
        with torch.device("meta"):
            components["vae"] = cls.from_config(source.load_config("vae"))
    return HunyuanVideo15Pipeline(**{**dict.fromkeys(names), **components})


# Stage 1 -------------------------------------------------------------------------------------------


image_inputs, image_size = hunyuanvideo15_i2v.image_inputs, hunyuanvideo15_i2v.image_size
encode_images = hunyuanvideo15_i2v.encode_images


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


def transformer_rules(tp_mode: str):
    import sharding

    return sharding.hunyuanvideo15_transformer_rules(tp_mode)


def cfg_enabled(guidance_scale: float) -> bool:
    """The pipeline's guider runs the unconditional branch unless the scale is 1 (its default formulation)."""
    return not math.isclose(guidance_scale, 1.0)


class GuidedTransformer(Guided):
    """One denoiser evaluation: [cond, uncond] as one batch of 2 (on `dp`) and the guider's combination,
    where the pipeline runs the two branches one after the other at batch 1."""

    CFG_ORDER = ("cond", "uncond")

    def __init__(self, transformer: torch.nn.Module, guider, do_cfg: bool, constrain=None) -> None:
        super().__init__(make_jit_safe(transformer), do_cfg, constrain)
        self.guider = guider

    def forward(self, latents, timestep, text, text_mask, text_2, text_mask_2, image_embeds, cond=None, mask=None):
        # Step-distilled (meanflow) checkpoints: `timestep` holds [t, the next step's t] (meanflow_timesteps).
        timestep, timestep_r = (timestep[:1], timestep[1:]) if timestep.shape[0] == 2 else (timestep, None)
        # Text-to-video: zero condition latents and mask channel (prepare_cond_latents_and_mask); image-to-video:
        # the image's (hunyuanvideo15_i2v.condition), and the image tokens count as valid text tokens.
        text_to_video = cond is None
        cond, mask = (torch.zeros_like(latents), torch.zeros_like(latents[:, :1])) if text_to_video else (cond, mask)
        # one per video, or one for all (the mask; a batch of videos with the same image)
        cond, mask = (tensor.expand(latents.shape[0], *tensor.shape[1:]) for tensor in (cond, mask))
        model_input = torch.cat([latents, cond, mask], dim=1)

        def predict(model_input):
            batch = model_input.shape[0]
            return self.transformer(
                hidden_states=model_input,
                image_embeds=image_embeds.repeat(batch // len(image_embeds), 1, 1),  # both branches, per video
                timestep=timestep.expand(batch).to(model_input.dtype),
                timestep_r=None if timestep_r is None else timestep_r.expand(batch).to(model_input.dtype),
                encoder_hidden_states=text,
                encoder_attention_mask=text_mask,
                encoder_hidden_states_2=text_2,
                encoder_attention_mask_2=text_mask_2,
                return_dict=False,
                text_to_video=text_to_video,
            )[0]

        # the guider's own combination
        return self.guided(model_input, predict, lambda cond, uncond: self.guider.forward(cond, uncond).pred)


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
    image = (
        hunyuanvideo15_i2v.planning_embeds(source, request, dtype) if hunyuanvideo15_i2v.image_to_video(source) else {}
    )
    return {**zeros, **{f"negative_{key}": value for key, value in zeros.items()}, **image}


transformer_components = common.one_transformer
latents_normalization = common.vae_scaling_factor


def meanflow_timesteps(timesteps: torch.Tensor):
    """The step-distilled checkpoints' timestep input: step i's timestep and the next one's (0 after the last),
    the pipeline's `timestep_r`."""
    following = torch.cat([timesteps[1:], timesteps.new_zeros(1)])
    return lambda i, t: torch.stack([t, following[i]])


def denoise_loop(source, request: Request, embeds: dict[str, torch.Tensor], dtype, transformers, runtime, tp_mode):
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
    image_inputs = hunyuanvideo15_i2v.transformer_image_inputs(source, embeds, latents, pipe, dtype)

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
        latents,
        latents_record(scheduler, do_cfg, common.vae_scaling_factor(source), flow_shift=request.flow_shift),
    )


# Stage 3: models/hunyuanvideo15_vae.py -------------------------------------------------------------

Decoder, video_processor = hunyuanvideo15_vae.Decoder, hunyuanvideo15_vae.video_processor


# Tiny preset (models/tiny.py builds it) -------------------------------------------------------------

TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 24, "num_inference_steps": 4, "flow_shift": 5.0}
PRESETS = {
    "tiny-hunyuanvideo15": Preset(NAME, tiny.hunyuanvideo15, TINY_DEFAULTS),
    # image-to-video: the size comes from the image (hunyuanvideo15_i2v.image_size)
    "tiny-hunyuanvideo15-i2v": Preset(NAME, functools.partial(tiny.hunyuanvideo15, image_to_video=True), TINY_DEFAULTS),
    # the step-distilled image-to-video checkpoint's layout: meanflow (a second timestep), shift 7, guidance 1
    "tiny-hunyuanvideo15-i2v-step-distilled": Preset(
        NAME,
        functools.partial(tiny.hunyuanvideo15, image_to_video=True, step_distilled=True),
        {**TINY_DEFAULTS, "flow_shift": 7.0},
    ),
}
