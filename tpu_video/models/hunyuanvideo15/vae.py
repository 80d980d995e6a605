"""HunyuanVideo-1.5's stage 3: the VAE made jit-safe (its attention's frame-causal mask without the per-token
loop), the decoder stage 3 runs with the pipeline's post-processor, and the decode in frame chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpu_video.engine.decode import frame_batches, run_in_chunks

from ..common import recorded_scaling_factor


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


class Decoder(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module, normalization: dict) -> None:
        super().__init__()
        self.vae = make_vae_jit_safe(vae)
        self.scaling_factor = recorded_scaling_factor(normalization)

    def forward(self, latents):
        # The pipeline's own expression: the scaling factor undone before decoding.
        latents = latents.to(self.vae.dtype) / self.scaling_factor
        return self.vae.decode(latents, return_dict=False)[0]


def video_processor(source):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return HunyuanVideo15ImageProcessor(vae_scale_factor=source.load_config("vae")["spatial_compression_ratio"])


# Stage 3 in frame chunks ------------------------------------------------------------------------------
# The stock decoder runs the whole clip at once: causal convolutions (replicate padding in time), RMS norms
# per position, temporal upsamplers whose first frame takes its own branch, and one mid-block attention in
# which each token sees every token of its own and earlier frames. Diffusers keeps no cache, so the forward
# is restructured here (the stock submodules do the arithmetic): each causal conv receives the last
# `kernel - 1` input frames of the previous chunk where the first chunk repeats its first frame; the
# attention appends the chunk's keys and values to buffers as long as the video (latest frames last, a count
# of frames seen) and masks what is not yet seen. Nothing spans a chunk otherwise, so any chunk length is
# exact; the remainder goes first, so two programs serve a video ("first" and "steady").

CHUNK_FRAMES = range(1, 33)  # latent frames per call: any count is exact (32: a whole 121-frame video)
PROGRAMS = ("first", "steady")


class _State:
    """One chunk's carried tensors in the decoder's order: those the previous chunk left (`take`: None on
    the first chunk) and those this one leaves (`keep`), each marked whether it stays whole on every device
    (`whole`: the attention's buffers, which every query reads) or split like the activations."""

    def __init__(self, previous: tuple | None, pin_whole=lambda tensor: tensor, pin_split=lambda tensor: tensor):
        self._previous = None if previous is None else iter(previous)
        self.left: list[torch.Tensor] = []
        self.whole: list[bool] = []
        self.pin_whole = pin_whole  # a tensor made whole on every device (a sharding constraint)
        self.pin_split = pin_split  # a tensor split like the latents, unevenly where it must

    def take(self) -> torch.Tensor | None:
        return None if self._previous is None else next(self._previous)

    def keep(self, tensor: torch.Tensor, whole: bool = False) -> None:
        self.left.append(tensor)
        self.whole.append(whole or tensor.dim() == 0)


def _conv(conv, x: torch.Tensor, state: _State) -> torch.Tensor:
    """HunyuanVideo15CausalConv3d on a chunk: the earlier frames in front, then its spatial padding."""
    before = conv.time_causal_padding[4]
    earlier = state.take()
    if earlier is None:  # the video's start: the stock replicate padding repeats the first frame
        earlier = x[:, :, :1].expand(-1, -1, before, -1, -1)
    frames = state.pin_split(torch.cat([earlier, x], dim=2))  # the carried frames may arrive whole
    state.keep(frames[:, :, frames.shape[2] - before :])
    return conv.conv(F.pad(frames, (*conv.time_causal_padding[:4], 0, 0), mode=conv.pad_mode))


def _resnet(block, x: torch.Tensor, state: _State) -> torch.Tensor:
    """HunyuanVideo15ResnetBlock.forward with its two convolutions' frames carried."""
    hidden = _conv(block.conv1, block.nonlinearity(block.norm1(x)), state)
    hidden = _conv(block.conv2, block.nonlinearity(block.norm2(hidden)), state)
    return hidden + (x if block.conv_shortcut is None else block.conv_shortcut(x))


def _attention(block, x: torch.Tensor, state: _State, video_frames: int) -> torch.Tensor:
    """HunyuanVideo15AttnBlock.forward on a chunk: its keys and values join the buffers of `video_frames`
    frames (latest last); a query sees the buffer's seen frames up to its own."""
    batch, channels, frames, height, width = x.shape
    normed = block.norm(x)
    query, key, value = block.to_q(normed), block.to_k(normed), block.to_v(normed)
    keys, values, seen = state.take(), state.take(), state.take()
    if keys is None:
        keys = key.new_zeros(batch, channels, video_frames, height, width)
        values, seen = torch.zeros_like(keys), torch.zeros((), dtype=torch.int32, device=x.device)
    # The chunk's keys and values made whole before they join the buffers, so only they are gathered.
    key, value = state.pin_whole(key), state.pin_whole(value)
    keys, values = (torch.cat([buffer[:, :, frames:], new], dim=2) for buffer, new in ((keys, key), (values, value)))
    seen = seen + frames
    for tensor in (keys, values, seen):  # whole: a split buffer would be all-gathered again every call
        state.keep(tensor, whole=True)
    tokens = height * width
    slot = torch.arange(video_frames * tokens, device=x.device) // tokens
    own = torch.arange(frames * tokens, device=x.device) // tokens + (video_frames - frames)
    mask = (slot[None, :] >= video_frames - seen) & (slot[None, :] <= own[:, None])

    def sequence(tensor):
        return tensor.reshape(batch, channels, -1).permute(0, 2, 1).unsqueeze(1)

    out = F.scaled_dot_product_attention(sequence(query), sequence(keys), sequence(values), attn_mask=mask)
    out = out.squeeze(1).reshape(batch, frames, height, width, channels).permute(0, 4, 1, 2, 3)
    return block.proj_out(out) + x


def _upsample(block, x: torch.Tensor, state: _State, first: bool) -> torch.Tensor:
    """HunyuanVideo15Upsample.forward on a chunk: only the video's first frame takes the one-frame branch."""
    hidden, rearrange = _conv(block.conv, x, state), block._dcae_upsample_rearrange
    if not block.add_temporal_upsample:
        return rearrange(hidden, r1=1) + rearrange(x.repeat_interleave(repeats=block.repeats, dim=1), r1=1)
    pieces = []
    if first:
        head = rearrange(hidden[:, :, :1], r1=1)
        shortcut = rearrange(x[:, :, :1], r1=1).repeat_interleave(repeats=block.repeats // 2, dim=1)
        pieces.append(head[:, : head.shape[1] // 2] + shortcut)
        hidden, x = hidden[:, :, 1:], x[:, :, 1:]
    if hidden.shape[2]:
        pieces.append(rearrange(hidden, r1=2) + rearrange(x, r1=2).repeat_interleave(repeats=block.repeats, dim=1))
    return torch.cat(pieces, dim=2)


def decode_chunk(decoder, latents: torch.Tensor, state: _State, first: bool, video_frames: int) -> torch.Tensor:
    """HunyuanVideo15Decoder3D.forward on a chunk of latent frames, its state carried in `state`."""
    hidden = _conv(decoder.conv_in, latents, state) + latents.repeat_interleave(repeats=decoder.repeat, dim=1)
    mid = decoder.mid_block
    hidden = _resnet(mid.resnets[0], hidden, state)
    for attention, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
        if attention is not None:
            hidden = _attention(attention, hidden, state, video_frames)
        hidden = _resnet(resnet, hidden, state)
    for up in decoder.up_blocks:
        for resnet in up.resnets:
            hidden = _resnet(resnet, hidden, state)
        for upsampler in up.upsamplers or ():
            # Split again after the upsampler's rearrange: a width split unevenly does not survive it.
            hidden = state.pin_split(_upsample(upsampler, hidden, state, first))
    return _conv(decoder.conv_out, decoder.conv_act(decoder.norm_out(hidden)), state)


class FramePrograms(torch.nn.Module):
    """The decode of one chunk as two methods: the pipeline's scaling undone (`decoder`, a `Decoder`), then
    `decode_chunk`; returns (pixels, the state's tensors), pinned to `layout` (the frame count seen is a
    replicated scalar). `video_frames`: the video's latent frames (the attention buffers' length)."""

    def __init__(self, decoder: Decoder, video_frames: int, constrain, layout) -> None:
        super().__init__()
        convs = [m for m in decoder.vae.decoder.modules() if hasattr(m, "time_causal_padding")]
        if any(conv.pad_mode != "replicate" for conv in convs):
            raise ValueError("the frame programs carry replicate-padded causal convolutions only")
        self.decoder = decoder
        self.video_frames = video_frames
        self.constrain = constrain
        self.layout = layout
        self.state_layouts: list[tuple] = []  # the last traced chunk's, per state tensor (for --plan)

    def _chunk(self, latents, previous):
        state = _State(
            previous,
            pin_whole=lambda tensor: self.constrain(tensor, (None,) * tensor.dim()),
            pin_split=lambda tensor: self.constrain(tensor, self.layout, uneven=True),
        )
        latents = self.constrain(latents, self.layout, uneven=True)  # engine.decode.latents_split
        latents = latents.to(self.decoder.vae.dtype) / self.decoder.scaling_factor
        out = decode_chunk(self.decoder.vae.decoder, latents, state, previous is None, self.video_frames)
        kept = zip(state.left, state.whole, strict=True)
        self.state_layouts = [(None,) * t.dim() if whole else self.layout for t, whole in kept]
        pinned = [self.constrain(t, layout) for t, layout in zip(state.left, self.state_layouts, strict=True)]
        return self.constrain(out, self.layout), *pinned

    def first(self, latents):
        return self._chunk(latents, None)

    def steady(self, latents, *state):
        return self._chunk(latents, state)


def frame_programs(source, decoder: Decoder, latents_shape, runtime, layout, chunk_frames: int):
    """tpu_video/models/family.py's `frame_programs` for HunyuanVideo-1.5."""
    spans = frame_batches(latents_shape[2], chunk_frames)
    programs = runtime.compile(FramePrograms(decoder, latents_shape[2], runtime.constrain, layout), methods=PROGRAMS)
    names = ["first"] + ["steady"] * (len(spans) - 1)
    return lambda latents: run_in_chunks(programs, names, spans, latents, runtime, layout)


def frame_plan(source, decoder: Decoder, latents_shape, runtime, layout, chunk_frames: int):
    """tpu_video/models/family.py's `frame_plan` for HunyuanVideo-1.5 (the VAE on the meta device): the steady
    program's state shapes from running the first on the meta device."""
    (start, end), *rest = frame_batches(latents_shape[2], chunk_frames)
    dtype = decoder.vae.dtype
    chunks = [torch.zeros(*latents_shape[:2], n, *latents_shape[3:], dtype=dtype) for n in (end - start, chunk_frames)]
    module = FramePrograms(decoder, latents_shape[2], runtime.constrain, layout)
    with torch.no_grad():
        meta = FramePrograms(decoder, latents_shape[2], lambda tensor, *_, **__: tensor, layout)
        _, *state = meta.first(chunks[0].to("meta"))
    steady = [(chunks[1], layout), *zip(state, meta.state_layouts, strict=True)]
    return module, {"first": [(chunks[0], layout)], "steady": steady}, {"first": 1, "steady": len(rest)}
