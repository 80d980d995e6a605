"""LTX-2's audio-video transformer on the mesh: made traceable, its weight rule table, Splash tiles and the
guided call that runs every guidance pass of a step as one batch.

What `make_jit_safe` changes (tests/test_ltx2.py holds the patched transformer equal to the stock one in
eager PyTorch):
- RoPE: the stock rotary modules compute their frequencies in float64 inside `forward`, which JAX without
  x64 (and every TPU) computes in float32. The tables are computed on the host by the stock modules and
  fed in (`TraceInputs.tables`); the patched modules return them.
- Text masks: the stock forward turns the prompt mask into an additive bias (0 / -10000) that the text
  cross-attention repeats per head; the patched processor passes the boolean key mask it encodes (the
  bias underflows to exactly zero weight in float32 and bfloat16, so nothing changes). A prompt with no
  valid token has a uniform bias, so there every key counts, as in the stock softmax.
- Spatio-temporal guidance: the stock processor tests `torch.all(perturbation_mask == 0)` in Python; the
  guided batch always holds an unperturbed branch, so that test is always false and is passed as such.
- Modality isolation per branch: the stock forward skips the audio<->video attentions for a whole call
  (`isolate_modalities`); here a 0/1 factor per branch (`TraceInputs.keep`) multiplies their outputs,
  which adds exactly zero on the isolated branch and leaves the others' values unchanged.
"""

from __future__ import annotations

import torch

from sharding import COLUMN, COLUMN_BIAS, REPLICATED, RuleTable, megatron_rules
from tpu_video.engine.guidance import BATCH
from tpu_video.workarounds.torchax import functional_split_rotary

from .guidance import Guidance

# Splash tiles: the other families' 512/512/512 until the TPU compiler has tried LTX-2's head dims
# (video 128, audio 64) (docs/planning.md).
SPLASH_BLOCK_SIZES = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
ATTENTIONS = r"(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
MASK_THRESHOLD = -9000.0  # the connectors' own binarisation threshold (attn_mask_binarize_threshold)


def transformer_rules(tp_mode: str = "megatron") -> RuleTable:
    """LTX2VideoTransformer3DModel (2.0, 2.3 and 2.5): all six attentions of a block (video and audio
    self-attention, their text cross-attentions, audio-to-video and video-to-audio) and both MLPs get the
    Megatron layout; q/k RMS norms span all heads, so their weights are split like q/k's columns; LTX-2.3's
    per-head gates like heads.
    Replicated: the per-block tables, the embedders, the output layers and the adaptive norms' modulation
    linears (440 MiB in bf16 at 19B): split on their input, as the other families split theirs, XLA left the
    modulated activations split along the width and gathered them again before every attention and MLP
    (libtpu, 19B at 512x768x121 on v6e-8, per block: 9 all-gathers of 583 MiB and 40 collective-permutes of
    360 MiB; replicated: none, docs/planning.md#ltx-2)."""
    block = r"transformer_blocks\.\d+\."
    later = (  # LTX-2.3: gated attention, prompt modulation
        (block + ATTENTIONS + r"\.to_gate_logits\.weight", COLUMN),
        (block + ATTENTIONS + r"\.to_gate_logits\.bias", COLUMN_BIAS),
        (block + r"(audio_)?prompt_scale_shift_table", REPLICATED),
        (r"(audio_)?prompt_adaln\..*", REPLICATED),
        (r"(audio_)?caption_projection\..*", REPLICATED),  # LTX-2.0 only: 2.3 projects in the connectors
        (r"keyframes_abs_pos_embedding", REPLICATED),  # LTX-2.5
    )
    rules = (
        megatron_rules(block, ATTENTIONS + r"\.to_[qkv]", ATTENTIONS + r"\.to_out\.0", r"(audio_)?ff", tp_mode)
        + (
            (block + ATTENTIONS + r"\.norm_[qk]\.weight", COLUMN_BIAS),
            (block + r"(audio_)?(a2v_cross_attn_)?scale_shift_table", REPLICATED),
            (block + r"video_a2v_cross_attn_scale_shift_table", REPLICATED),
            (r"(audio_time_embed|time_embed|av_cross_attn_\w+)\..*", REPLICATED),
            (r"(audio_)?proj_(in|out)\.(weight|bias)", REPLICATED),
            (r"(audio_)?scale_shift_table", REPLICATED),
        )
        + later
    )
    optional = frozenset(range(len(rules) - len(later), len(rules)))
    return RuleTable(f"ltx2-transformer/{tp_mode}", rules, optional)


class TraceInputs:
    """What the patched modules read during one guided call: the RoPE tables by module name, each (cos, sin)
    for one sample, and the per-branch factor on the audio<->video attentions (None: every branch keeps them)."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keep: torch.Tensor | None = None
        self.perturbation: torch.Tensor | None = None  # the STG pass's (rows, 1, 1) mask, 0 on its rows


def key_mask(bias: torch.Tensor) -> torch.Tensor:
    """The boolean key mask (B, 1, Skv) an additive prompt bias (B, 1, Skv) encodes."""
    valid = bias >= MASK_THRESHOLD
    return valid | ~valid.any(dim=-1, keepdim=True)  # no valid key: the stock bias is uniform, every key counts


def key_mask_processor():
    """LTX2AudioVideoAttnProcessor passing the boolean key mask instead of the additive bias."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

    class KeyMaskLTX2AttnProcessor(LTX2AudioVideoAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *rotary):
            mask = None if attention_mask is None else key_mask(attention_mask)
            return super().__call__(attn, hidden_states, encoder_hidden_states, mask, *rotary)

    return KeyMaskLTX2AttnProcessor()


def some_unperturbed_processor():
    """LTX2PerturbedAttnProcessor told that not every sample is perturbed (the guided batch always holds
    an unperturbed branch), instead of testing it on tensor values."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

    class SomeUnperturbedLTX2AttnProcessor(LTX2PerturbedAttnProcessor):
        def __call__(self, *args, perturbation_mask=None, all_perturbed=None, **kwargs):
            return super().__call__(*args, perturbation_mask=perturbation_mask, all_perturbed=False, **kwargs)

    return SomeUnperturbedLTX2AttnProcessor()


def make_jit_safe(transformer: torch.nn.Module) -> TraceInputs:
    """The one place LTX-2's transformer is adapted for jit (see the module docstring); returns what its
    patched modules read. Patches once: a batch builds one loop per video on the same module, and those
    share its inputs."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

    if hasattr(transformer, "trace_inputs"):
        return transformer.trace_inputs
    inputs = transformer.trace_inputs = TraceInputs()
    for name in ROPES:

        def fixed_tables(coords, device=None, name=name):
            cos, sin = inputs.tables[name]
            batch = coords.shape[0]
            return cos.expand(batch, *cos.shape[1:]), sin.expand(batch, *sin.shape[1:])

        getattr(transformer, name).forward = fixed_tables

    def keep_branches(module, args, output):
        return output if inputs.keep is None else output * inputs.keep.to(output.dtype)[:, None, None]

    for block in transformer.transformer_blocks:
        block.attn2.set_processor(key_mask_processor())
        block.audio_attn2.set_processor(key_mask_processor())
        for attention in (block.attn1, block.audio_attn1):
            if isinstance(attention.processor, LTX2PerturbedAttnProcessor):
                attention.set_processor(some_unperturbed_processor())
        block.audio_to_video_attn.register_forward_hook(keep_branches)
        block.video_to_audio_attn.register_forward_hook(keep_branches)
    return inputs


def rope_tables(transformer: torch.nn.Module, video_coords: torch.Tensor, audio_coords: torch.Tensor) -> dict:
    """The stock rotary modules' tables for one sample's coordinates, computed on the host (float64 inside) by
    the class's own `forward` (make_jit_safe replaces the instances')."""
    coords = {"rope": video_coords, "audio_rope": audio_coords}
    coords |= {"cross_attn_rope": video_coords[:, 0:1, :], "cross_attn_audio_rope": audio_coords[:, 0:1, :]}
    tables = {}
    with torch.no_grad():
        for name in ROPES:
            module = getattr(transformer, name)
            tables[name] = type(module).forward(module, coords[name])
    return tables


class GuidedTransformer(torch.nn.Module):
    """One denoising step's prediction for both streams: every guidance pass (`Guidance.branches`) of every
    video in the batch as one transformer batch, combined in x0 space as LTX2Pipeline combines them, and
    returned as velocities. The rows are branch-major (every video's first pass, then every video's second),
    the order tpu_video/engine/batching.py joins the prompts in.

    The latents are both streams' packed latents flattened and concatenated (video first), so the shared
    loop and the scheduler step them as one tensor: FlowMatch Euler's step is elementwise, and the
    pipeline's two schedulers are copies with the same sigmas.
    """

    def __init__(self, transformer, guidance: Guidance, dtype, shapes, geometry, constrain=None, conditioning=None):
        super().__init__()
        # "first_frame" (image-to-video): a static input marks the first frame's tokens, whose timestep is 0;
        # "blend" (conditions): a static conditioning mask scales each token's timestep and blends the guided
        # video prediction with the static clean latents (LTX2ConditionPipeline).
        self.conditioning = conditioning
        self.inputs = make_jit_safe(transformer)
        self.transformer = transformer
        self.guidance = guidance
        self.dtype = dtype
        self.video_shape, self.audio_shape = shapes  # packed (tokens, channels) of each stream
        self.geometry = geometry  # the transformer's num_frames, height, width, fps, audio_num_frames
        self.constrain = constrain or (lambda tensor, spec: tensor)

    def scan_block_arguments(self, first: int, end: int) -> dict[str, torch.Tensor]:
        """For blocks first..end-1 run as one scan (tpu_video/engine/scanned_blocks.py): the perturbation mask each
        block gets, stacked. The stock forward passes the STG pass's mask to the --stg_blocks and none to the
        others; here the others get ones, for which the perturbed processor's `torch.lerp(value, attention,
        1)` returns the attention exactly (torch's lerp takes `end` itself at weight >= 0.5)."""
        mask = self.inputs.perturbation
        if mask is None:
            return {}
        ones = torch.ones_like(mask)
        stg = set(self.guidance.stg_blocks)
        return {"perturbation_mask": torch.stack([mask if block in stg else ones for block in range(first, end)])}

    @property
    def block_streams(self):
        """The blocks' two streams for the interval cache (tpu_video/engine/cached_blocks.py) and the block scan (its
        carry): the video's hidden states and, where other families' blocks return their text tokens, the
        audio's. diffusers' block registry has no entry for LTX-2's blocks."""
        from diffusers.hooks._helpers import TransformerBlockMetadata
        from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock

        streams = TransformerBlockMetadata(0, 1, "hidden_states", "audio_hidden_states")
        streams._cls = LTX2VideoTransformerBlock  # as TransformerBlockRegistry.register sets it
        return streams

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.video_shape[0] * self.video_shape[1]
        video = latents[:, :size].reshape(latents.shape[0], *self.video_shape)
        return video, latents[:, size:].reshape(latents.shape[0], *self.audio_shape)

    def forward(self, latents, timestep, prompt_embeds, audio_prompt_embeds, attention_mask, *rest):
        """`latents`: (videos, both streams' tokens); `timestep`: (t, sigma); the prompts: one row per branch
        and video; `rest`: with conditioning the (1, video tokens) mask (for "blend" then the (videos, video
        tokens, channels) clean latents), then ROPES' (cos, sin) pairs (the videos of a batch share their
        geometry, so their tables)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        mask, rest = (rest[0], rest[1:]) if self.conditioning else (None, rest)
        clean, tables = (rest[0], rest[1:]) if self.conditioning == "blend" else (None, rest)

        branches = self.guidance.branches
        videos = latents.shape[0]
        count = len(branches) * videos

        def per_row(value_of_branch) -> torch.Tensor:
            return torch.tensor(
                [float(value_of_branch(b)) for b in branches for _ in range(videos)], device=latents.device
            )

        self.inputs.tables = {name: (tables[2 * i], tables[2 * i + 1]) for i, name in enumerate(ROPES)}
        self.inputs.keep = per_row(lambda branch: branch != "isolated") if "isolated" in branches else None
        stg = "stg" in branches
        perturbation = per_row(lambda branch: branch != "stg").to(self.dtype) if stg else None
        self.inputs.perturbation = None if perturbation is None else perturbation[:, None, None]
        video, audio = self.split(latents)
        t, sigma = timestep[0], timestep[1]
        # The pipelines' per-token video timestep with conditioning: t x (1 - mask), zero on a frame kept as given.
        video_t = t.expand(count) if mask is None else (t.reshape(1, 1) * (1 - mask)).expand(count, -1)
        frames, height, width, fps, audio_frames = self.geometry
        with functional_split_rotary():  # tpu_video/workarounds/torchax.py
            video_out, audio_out = self.transformer(
                hidden_states=self.constrain(video.to(self.dtype).repeat(len(branches), 1, 1), BATCH),
                audio_hidden_states=self.constrain(audio.to(self.dtype).repeat(len(branches), 1, 1), BATCH),
                encoder_hidden_states=prompt_embeds,
                audio_encoder_hidden_states=audio_prompt_embeds,
                timestep=video_t,
                audio_timestep=t.expand(count),
                sigma=t.expand(count),  # the pipeline passes the timestep as sigma too (LTX-2.3's prompt modulation)
                encoder_attention_mask=attention_mask,
                audio_encoder_attention_mask=attention_mask,
                num_frames=frames,
                height=height,
                width=width,
                fps=fps,
                audio_num_frames=audio_frames,
                video_coords=torch.zeros(
                    count, 3, 1, 2, device=latents.device
                ),  # only its batch size is read (the tables are fed in)
                audio_coords=torch.zeros(count, 1, 1, 2, device=latents.device),
                spatio_temporal_guidance_blocks=list(self.guidance.stg_blocks) if stg else None,
                perturbation_mask=perturbation,
                use_cross_timestep=True,
                return_dict=False,
            )
        self.inputs.tables, self.inputs.keep, self.inputs.perturbation = {}, None, None
        velocities = []
        for sample, prediction, scales in (
            (video, video_out, self.guidance.video),
            (audio, audio_out, self.guidance.audio),
        ):
            x0 = dict(zip(branches, (sample - v * sigma for v in prediction.float().split(videos)), strict=True))
            guided = x0["cond"]
            if self.guidance.cfg:
                guided = guided + (scales.cfg - 1) * (x0["cond"] - x0["uncond"])
            if stg:
                guided = guided + scales.stg * (x0["cond"] - x0["stg"])
            if "isolated" in branches:
                guided = guided + (scales.modality - 1) * (x0["cond"] - x0["isolated"])
            if scales.rescale > 0:
                guided = rescale_noise_cfg(guided, x0["cond"], guidance_rescale=scales.rescale)
            if clean is not None and sample is video:  # held toward the conditions, in x0 space
                guided = (guided * (1 - mask[..., None]) + clean * mask[..., None]).to(guided.dtype)
            velocities.append(((sample - guided) / sigma).flatten(1))
        return torch.cat(velocities, dim=1)
