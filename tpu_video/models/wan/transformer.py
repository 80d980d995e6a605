"""Wan's transformer on the mesh: the weight rule table, the activation layouts between blocks, the Splash
tiles, and one expert's guided call (transformer + CFG as one graph). The stock transformer traces as it is."""

from __future__ import annotations

import functools

import torch

from sharding import COLUMN, COLUMN_BIAS, DP, MODULATION, REPLICATED, ROW, SP, RuleTable, megatron_rules
from tpu_video.attention.calls import mark_cross_attention
from tpu_video.engine.guidance import Guided, cfg_combination

from ..common import constrain_block_inputs
from ..family import PublishedBlock

# Splash tiles: 512/512/512, the tiles measured to compile on v5e, v5p, v6e and tpu7x for head dim 128
# (benchmarks/tpu_plan.py --tiles); 720p/81 frames (75,600 tokens) pads by 0.23%, the 512-token
# prompt not at all.
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}

# The text the blocks attend to: the pipeline's prompt layout, valid tokens then zeros up to 512. Kept here, not
# in config.py, so published_block can read it: config imports vace, which imports this module.
MAX_SEQUENCE_LENGTH = 512
# Each block's positional inputs: video tokens (on sp between blocks), prompt tokens, its modulation
# (batch, 6, width), and the final norm's input: all unsplit along the width. Left free, the
# partitioner splits them over tp and all-gathers them again before the next linear (XLA:CPU, 2x1x4
# mesh: 3 all-gathers of the video tokens per block and 3 more outside; with the pins, none).
BLOCK_INPUTS = {0: (DP, SP, None), 1: (DP, None, None), 2: (DP, None, None)}


def published_block(video_tokens: int, batch: int, make) -> PublishedBlock:
    """Wan 2.1 T2V 14B's transformer (also each Wan 2.2 A14B expert) at one block on the meta device (stage 2
    runs the stock processors), and the block's inputs (family.Family.published_block)."""
    from diffusers import WanTransformer3DModel

    from .published import WAN_14B_TRANSFORMER

    with torch.device("meta"):
        model = WanTransformer3DModel(**{**WAN_14B_TRANSFORMER, "num_layers": 1})
    config, f32 = model.config, torch.float32
    width, head_dim = config.num_attention_heads * config.attention_head_dim, config.attention_head_dim
    inputs = [
        make((batch, video_tokens, width), f32, BLOCK_INPUTS[0]),  # hidden_states
        make((batch, MAX_SEQUENCE_LENGTH, width), f32, BLOCK_INPUTS[1]),  # encoder_hidden_states
        make((batch, 6, width), f32, BLOCK_INPUTS[2]),  # timestep_proj
        tuple(make((1, video_tokens, 1, head_dim), f32, REPLICATED) for _ in range(2)),  # rotary cos, sin
    ]
    return PublishedBlock("wan2.1-14b", model, "blocks", inputs, returns_text=False)


def transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """WanTransformer3DModel (Wan 2.1 and 2.2, text- and image-to-video): self- and cross-attention and the
    MLP get the Megatron layout; q/k RMS norms span all heads, so their weights are split like q/k's columns.

    Modulation: one `condition_embedder.time_proj` (width -> 6 x width, 14B: 157 M parameters) feeds
    every block, which only adds its own `scale_shift_table` (6 x width). time_proj is split on its
    input (MODULATION): one all-reduce of (batch, 6 x width) per step, not per block, and the tables
    stay replicated (6 x width each, fp32) so no block needs a collective for its modulation.
    Image-to-video (Wan 2.1 I2V, optional rules): the cross-attention's image keys and values are split
    like its text ones, their RMS norm like norm_k; the image embedder (CLIP width -> width, once per
    run's tokens) stays replicated. Replicated: the patch, time and text embedders and the output layers.
    VACE (WanVACETransformer3DModel, optional rules): its VACE blocks are laid out as the main ones; their
    input and output projections (width x width, one all-reduce each were they split) and the control's
    patch embedding stay replicated. Animate (WanAnimateTransformer3DModel, optional rules): its face adapters'
    cross-attentions (video tokens to each frame's face tokens) Megatron like the blocks' attentions, their
    per-head norms replicated; the pose patch embedding, the motion encoder (small convolutions and linears
    over the face frames) and the face encoder replicated."""
    block = r"(vace_)?blocks\.\d+\."
    row = ROW if tp_mode == "megatron" else REPLICATED
    optional_rules = (  # image-to-video's, VACE's and Animate's
        (block + r"attn2\.add_[kv]_proj\.weight", COLUMN),
        (block + r"attn2\.add_[kv]_proj\.bias", COLUMN_BIAS),
        (block + r"attn2\.norm_added_k\.weight", COLUMN_BIAS),
        (r"condition_embedder\.image_embedder\..*", REPLICATED),
        (r"vace_blocks\.\d+\.proj_(in|out)\.(weight|bias)", REPLICATED),
        (r"vace_patch_embedding\.(weight|bias)", REPLICATED),
        (r"face_adapter\.\d+\.to_[qkv]\.weight", COLUMN),
        (r"face_adapter\.\d+\.to_[qkv]\.bias", COLUMN_BIAS),
        (r"face_adapter\.\d+\.to_out\.weight", row),
        (r"face_adapter\.\d+\.(to_out\.bias|norm_[qk]\.weight)", REPLICATED),
        (r"(pose_patch_embedding|motion_encoder|face_encoder)\..*", REPLICATED),
    )
    rules = (
        megatron_rules(block, r"attn[12]\.to_[qkv]", r"attn[12]\.to_out\.0", "ffn", tp_mode)
        + (
            (block + r"attn[12]\.norm_[qk]\.weight", COLUMN_BIAS),
            (block + r"scale_shift_table", REPLICATED),
            (block + r"norm2\.(weight|bias)", REPLICATED),  # cross-attention LayerNorm
            (r"condition_embedder\.time_proj\.weight", MODULATION),
            (r"condition_embedder\.time_proj\.bias", REPLICATED),
            (r"condition_embedder\.(time_embedder|text_embedder)\..*", REPLICATED),
            (r"patch_embedding\.(weight|bias)", REPLICATED),
            (r"(scale_shift_table|proj_out\.(weight|bias))", REPLICATED),
        )
        + optional_rules
    )
    optional = frozenset(range(len(rules) - len(optional_rules), len(rules)))
    return RuleTable(f"wan-transformer/{tp_mode}", rules, optional)


def spans_after(layers, blocks: int) -> list[tuple[int, int]]:
    """The runs of blocks [first, end) of `blocks` that a forward adding something to the video tokens after
    each block of `layers` (VACE's hints, Animate's face adapters) adds nothing inside: each ends with such a
    block or with the last block (a block scan's spans)."""
    ends = [layer + 1 for layer in sorted(layers) if layer + 1 <= blocks] + [blocks]
    starts = [0, *ends[:-1]]
    return sorted({(first, end) for first, end in zip(starts, ends, strict=True) if end > first})


class GuidedTransformer(Guided):
    """One expert's denoiser evaluation: [cond, uncond] as one batch of 2 (on `dp`), where the pipeline
    makes two batch-1 calls, and its guidance expression with this expert's scale."""

    CFG_ORDER = ("cond", "uncond")

    def __init__(
        self, transformer, dtype, do_cfg: bool, guidance_scale: float, constrain=None, per_token=False, barrier=None
    ) -> None:
        super().__init__(transformer, do_cfg, constrain)
        for block in transformer.blocks:  # video tokens to the prompt (and image): no local window there
            mark_cross_attention(block.attn2)
        self.dtype = dtype  # the pipeline's `transformer_dtype` (fp32-kept modules aside)
        self.guidance_scale = guidance_scale
        if constrain is not None:
            # per-token timesteps make each block's modulation (batch, tokens, 6, width), split like the tokens
            specs = {**BLOCK_INPUTS, 2: (DP, SP, None, None)} if per_token else BLOCK_INPUTS
            constrain_block_inputs(transformer.blocks, constrain, specs, barrier if per_token else None)
            constrain_block_inputs([transformer.norm_out], constrain, specs)

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
