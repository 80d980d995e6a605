"""HunyuanVideo-1.5 (diffusers `HunyuanVideo15Pipeline`, text-to-video): the transformer made traceable.

Two spots of `HunyuanVideo15Transformer3DModel.forward` cannot be traced by jax.jit:
- `if torch.all(image_embeds == 0)` branches on tensor values (ConcretizationTypeError). Text-to-video
  always passes zero image embeddings, so the branch is a Python argument here (`text_to_video`).
- The text-token reorder (valid image, ByT5 and Qwen tokens first, then the padding, per sample)
  indexes with boolean masks, whose result shape depends on the values. A stable argsort of the
  concatenated validity mask gives the same order with static shapes, and a gather applies it.

The VAE's attention builds its frame-causal mask with a Python loop over every token (64 s to trace
at 2048 tokens, ../shared/PITFALLS.md); `frame_causal_mask` builds the identical mask from a
comparison of frame indices.

`traceable_forward` is the stock forward with only those two spots rewritten (same submodules, same
order of operations); tests/test_hunyuanvideo15_patches.py holds it equal to the stock forward in eager
PyTorch. Attention then receives the dense (B, 1, S, S) `valid_i & valid_j` mask, which the Splash
override reduces to per-key and per-query vectors.
"""

from __future__ import annotations

import types

import torch

NAME = "hunyuanvideo15"


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


def make_jit_safe(transformer: torch.nn.Module) -> torch.nn.Module:
    """The one place HunyuanVideo-1.5's transformer is adapted for jit (see the module docstring)."""
    transformer.forward = types.MethodType(traceable_forward, transformer)
    return transformer


def frame_causal_mask(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None) -> torch.Tensor:
    """AutoencoderKLHunyuanVideo15's `prepare_causal_attention_mask` without the per-token loop: token i
    sees every token of its own and earlier frames (0), nothing later (-inf)."""
    frame = torch.arange(n_frame * n_hw, device=device) // n_hw
    mask = torch.where(frame[None, :] <= frame[:, None], 0.0, float("-inf")).to(dtype)
    if batch_size is not None:
        mask = mask.unsqueeze(0).expand(batch_size, -1, -1)
    return mask


def make_vae_jit_safe(vae: torch.nn.Module) -> torch.nn.Module:
    """The one place HunyuanVideo-1.5's VAE is adapted for jit: every attention block gets `frame_causal_mask`."""
    for module in vae.modules():
        if hasattr(module, "prepare_causal_attention_mask"):
            module.prepare_causal_attention_mask = frame_causal_mask
    return vae


def build_tiny_transformer(seed: int = 0) -> torch.nn.Module:
    """A random tiny HunyuanVideo15Transformer3DModel (t2v): 8 heads x 8, 2 blocks, 1 refiner block."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=8,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=1,
        text_embed_dim=16,
        text_embed_2_dim=8,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        task_type="t2v",
    ).eval()
