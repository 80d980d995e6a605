"""CogVideoX's transformer on the mesh: the jit-safe attention processor, the weight rule table, the
activation layouts between blocks, the Splash tiles, and the guided call (transformer + CFG as one graph)."""

from __future__ import annotations

import functools

import torch

from sharding import DP, MODULATION, REPLICATED, SP, RuleTable, megatron_rules
from tpu_video.engine.guidance import Guided, cfg_combination

from ..common import constrain_block_inputs
from ..family import PublishedBlock

# Splash tiles. The reference notes measured 3328/2816/256 fastest for CogVideoX1.5 at 768x1360 on v6e
# (speed is not measurable without a TPU). The TPU compiler (benchmarks/tpu_plan.py) shows it compiles
# on v6e-8 and tpu7x-8 and pads 45,106 tokens by 3.2% (queries) and 5.8% (keys); it overflows the 16 MiB
# of scoped VMEM on v5e and v5p, where stage 2 uses tpus.Generation.splash_tile_cap instead.
SPLASH_BLOCK_SIZES = {"block_q": 3328, "block_kv": 2816, "block_kv_compute": 256}


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


def published_block(video_tokens: int, batch: int, make) -> PublishedBlock:
    """CogVideoX1.5-5B's transformer at one block on the meta device, patched as stage 2 runs it, and the
    block's inputs (family.Family.published_block)."""
    from diffusers import CogVideoXTransformer3DModel

    from .published import COGVIDEOX15_5B_TRANSFORMER

    with torch.device("meta"):
        model = make_jit_safe(CogVideoXTransformer3DModel(**{**COGVIDEOX15_5B_TRANSFORMER, "num_layers": 1}))
    config, f32 = model.config, torch.float32
    width, head_dim = config.num_attention_heads * config.attention_head_dim, config.attention_head_dim
    inputs = [
        make((batch, video_tokens, width), f32, BLOCK_INPUTS["hidden_states"]),
        make((batch, config.max_text_seq_length, width), f32, BLOCK_INPUTS["encoder_hidden_states"]),
        make((batch, config.time_embed_dim), f32, (DP, None)),  # temb
        (make((video_tokens, head_dim), f32, REPLICATED), make((video_tokens, head_dim), f32, REPLICATED)),  # rotary
    ]
    return PublishedBlock("cogvideox1.5-5b", model, "transformer_blocks", inputs, returns_text=True)


def transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """CogVideoXTransformer3DModel (1.0 and 1.5). AdaLN modulation linears are split on their input
    (MODULATION). Norms, embeddings and the output projection are small next to the blocks and stay
    replicated, so nothing outside the blocks needs a collective."""
    block = r"transformer_blocks\.\d+\."
    rules = megatron_rules(block, r"attn1\.to_[qkv]", r"attn1\.to_out\.0", "ff", tp_mode) + (
        (block + r"attn1\.norm_[qk]\.(weight|bias)", REPLICATED),  # per-head-dim LayerNorm
        (block + r"norm[12]\.linear\.weight", MODULATION),
        (block + r"norm[12]\.(linear|norm)\.(weight|bias)", REPLICATED),  # AdaLN bias, LayerNorm
        (r"patch_embed\..*", REPLICATED),
        (r"time_embedding\..*", REPLICATED),
        (r"(norm_final|norm_out\.(linear|norm))\.(weight|bias)", REPLICATED),
        (r"proj_out\.(weight|bias)", REPLICATED),
        (r"ofs_embedding\..*", REPLICATED),  # CogVideoX 1.5 I2V's ofs embedding: optional, the last rule
    )
    return RuleTable(f"cogvideox-transformer/{tp_mode}", rules, frozenset({len(rules) - 1}))


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
