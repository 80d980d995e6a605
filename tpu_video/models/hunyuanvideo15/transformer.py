"""HunyuanVideo-1.5's transformer on the mesh: made traceable, its weight rule table, Splash tiles and the
guided call.

Two spots of `HunyuanVideo15Transformer3DModel.forward` cannot be traced by jax.jit:
- `if torch.all(image_embeds == 0)` branches on tensor values (ConcretizationTypeError). Text-to-video
  always passes zero image embeddings, so the branch is a Python argument here (`text_to_video`).
- The text-token reorder (valid image, ByT5 and Qwen tokens first, then the padding, per sample)
  indexes with boolean masks, whose result shape depends on the values. A stable argsort of the
  concatenated validity mask gives the same order with static shapes, and a gather applies it.

The VAE's attention builds its frame-causal mask with a Python loop over every token (64 s to trace
at 2048 tokens, measured here); `vae.frame_causal_mask` builds the identical mask from a
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

import types

import torch

from sharding import DP, MODULATION, REPLICATED, SP, RuleTable, megatron_rules
from tpu_video.engine.guidance import Guided

from ..family import PublishedBlock

# Splash tiles: 512/512/512 compiles on v5e, v5p, v6e and tpu7x (TPU compiler, benchmarks/tpu_plan.py)
# and pads the 720p/121-frame sequence (113,585 tokens) by 0.07%; the reference notes' 2048/2048 pads
# 0.97% and does not fit v5e/v5p's scoped VMEM. Which is faster is unmeasured (no TPU here).
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}


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


def published_block(video_tokens: int, batch: int, make) -> PublishedBlock:
    """HunyuanVideo-1.5's transformer (diffusers' default config is the published one) at one block on the
    meta device, with the processors stage 2 installs (per-key masks, not the dense S x S mask), and the
    block's inputs (family.Family.published_block): the text is the pipeline's 1000 Qwen tokens, 256 ByT5
    tokens and 729 image tokens, after the reorder."""
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        model = make_jit_safe(HunyuanVideo15Transformer3DModel(num_layers=1, num_refiner_layers=1, task_type="t2v"))
    config, f32, text = model.config, torch.float32, 1000 + 256 + 729
    width, head_dim = config.num_attention_heads * config.attention_head_dim, config.attention_head_dim
    inputs = [
        make((batch, video_tokens, width), f32, (DP, SP, None)),  # hidden_states
        make((batch, text, width), f32, (DP, None, None)),  # encoder_hidden_states
        make((batch, width), f32, (DP, None)),  # temb
        make((batch, text), torch.bool, (DP, None)),  # encoder attention mask
        (make((video_tokens, head_dim), f32, REPLICATED), make((video_tokens, head_dim), f32, REPLICATED)),
    ]
    return PublishedBlock("hunyuanvideo1.5", model, "transformer_blocks", inputs, returns_text=True)


def transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """HunyuanVideo15Transformer3DModel: double-stream blocks (image stream `to_*`/`ff`, text stream
    `add_*`/`to_add_out`/`ff_context`) and the token refiner's blocks get the Megatron layout.
    The blocks' AdaLN modulation linears are split on their input (MODULATION). Replicated: their
    biases, q/k RMS norms over the head dim, the refiner's small modulations, the ByT5 mapper,
    embedders and the final layers."""
    block = r"transformer_blocks\.\d+\."
    refiner = r"context_embedder\.token_refiner\.refiner_blocks\.\d+\."
    return RuleTable(
        f"hunyuanvideo15-transformer/{tp_mode}",
        megatron_rules(
            block, r"attn\.(to_[qkv]|add_[qkv]_proj)", r"attn\.(to_out\.0|to_add_out)", "(ff|ff_context)", tp_mode
        )
        + megatron_rules(refiner, r"attn\.to_[qkv]", r"attn\.to_out\.0", "ff", tp_mode)
        + (
            (block + r"attn\.norm_(added_)?[qk]\.weight", REPLICATED),
            (block + r"norm1(_context)?\.linear\.weight", MODULATION),
            (block + r"norm1(_context)?\.linear\.bias", REPLICATED),
            (refiner + r"(norm1|norm2|norm_out\.linear)\.(weight|bias)", REPLICATED),
            (r"context_embedder\.(time_text_embed|proj_in)\..*", REPLICATED),
            (r"context_embedder_2\..*", REPLICATED),  # ByT5 mapper
            (r"(x_embedder|image_embedder|time_embed)\..*", REPLICATED),
            (r"cond_type_embed\.weight", REPLICATED),
            (r"(norm_out\.linear|proj_out)\.(weight|bias)", REPLICATED),
        ),
    )


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
        # the image's (i2v.condition), and the image tokens count as valid text tokens.
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
        # read by key: torch.compile (dynamo, torch 2.11 and 2.13) builds the GuiderOutput without its `.pred`
        # attribute (AttributeError), which refused the torch.compile baselines of benchmarks/gpu_step.py
        return self.guided(model_input, predict, lambda cond, uncond: self.guider.forward(cond, uncond)["pred"])
