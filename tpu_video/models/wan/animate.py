"""Wan Animate (`WanAnimatePipeline`, `WanAnimateTransformer3DModel`): a character image moved by a pose video
and a face video (`--mode animate`), or put in place of the person of a background video where a mask video is
white (`--mode replace`). Stage 1's inputs and encodes: animate_inputs.py.

The pipeline pads the videos (reflected) to a whole number of segments of `segment_frame_length` frames, each
after the first starting with the last `prev_segment_conditioning_frames` of the one before, and denoises them in
order: each from its own noise with one latent frame more (the character's) and a fresh scheduler, the reference
(the character's latents, then the segment's condition latents) concatenated on channels every step, the
unconditional branch with the face blanked to -1 (the pipeline's guidance, off at its default scale 1). Between
two segments it decodes the one just made and VAE-encodes its last frames (in `replace` mode followed by the
background) as the next one's condition: stage 2 does that on its own devices in float32, as the pipeline's example
runs its VAE, one frame chunk per program call (`SegmentLoops`, vae_encode.py's `coder_programs`;
tpu_video/engine/segments.py runs the segments and keeps them in checkpoints). Stage 2
writes every segment's latents without the character's frame, one per row of `latents`; stage 3 decodes them one
by one, drops each later segment's first frames (the previous ones' repeated) and keeps the pose video's length.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from tpu_video.attention.plan import AttentionPlan
from tpu_video.cli import UserError, log
from tpu_video.engine.decode import split_over_mesh
from tpu_video.engine.denoise import NOISE_DTYPE
from tpu_video.engine.guidance import BATCH, cfg_combination
from tpu_video.engine.meta import meta_module
from utils import Request

from . import vae_encode
from .declarations import SEGMENT_FRAMES
from .transformer import GuidedTransformer, spans_after

# Stage 1's tensors: [i2v mask, latents] on channels for the character (one frame) and the first segment's
# condition; every segment's pose latents (one per row); the padded face, background and mask videos' pixels.
CHARACTER, CONDITION, POSE, FACE = "animate_character", "animate_condition", "pose_latents", "face_pixels"
BACKGROUND, MASK = "background_pixels", "mask_pixels"


def stored_pixels(pixels: torch.Tensor, normalized: bool) -> torch.Tensor:
    """The background or mask video's processed pixels as stage 1 writes them: the 8-bit values they came from
    (the pipeline's processors resize the frames in PIL, then divide by 255, and the video's map to [-1, 1]),
    a quarter of float32's bytes."""
    return ((pixels + 1) / 2 if normalized else pixels).mul(255).round().to(torch.uint8)


def processed_pixels(stored: torch.Tensor, normalized: bool) -> torch.Tensor:
    """`stored_pixels` back, as the processors compute them (the same operations: bit for bit); float32 as
    written by stage 1 before 2026-11-28, as it is."""
    if stored.dtype != torch.uint8:
        return stored
    pixels = stored.to(torch.float32) / 255.0
    return 2.0 * pixels - 1.0 if normalized else pixels


VAE_ATTENTION = AttentionPlan("xla")  # the VAE's one-head attention over a frame's pixels: plain, as in stage 3
_CODER: dict = {}  # the VAE's programs between segments, placed once (SegmentLoops._coder)
DEFAULTS = {"height": 720, "width": 1280, "fps": 30, "num_inference_steps": 20, "guidance_scale": 1.0}


def is_animate(source) -> bool:
    return source.index.get("_class_name") == "WanAnimatePipeline"


def segment_options(request: Request) -> tuple[int, int]:
    """(segment_frame_length, prev_segment_conditioning_frames) as the request sets them."""
    length = request.option("segment_frame_length")
    previous = request.option("prev_segment_conditioning_frames")
    return (SEGMENT_FRAMES if length is None else length), (1 if previous is None else previous)


def segment_count(request: Request) -> tuple[int, int]:
    """(how many segments, the frames they cover): the pipeline's count for the pose video's frames
    (--num_frames), padded to the next whole segment."""
    length, previous = segment_options(request)
    step = length - previous
    last = (request.num_frames - previous) % step
    target = request.num_frames + (step - last if last else 0)
    return target // step, target


def latent_frames(source, request: Request) -> int:
    """The transformer's frames: the segment's latent frames and the character's one before them."""
    return (segment_options(request)[0] - 1) // source.load_config("vae")["scale_factor_temporal"] + 2


def check_request(source, request: Request) -> None:
    """The segment options, and a pose video longer than the frames a segment carries over."""
    length, previous = segment_options(request)
    temporal = source.load_config("vae")["scale_factor_temporal"]
    if length < 1 or (length - 1) % temporal:
        raise UserError(f"--segment_frame_length {length} must be {temporal}n+1 (e.g. {SEGMENT_FRAMES})")
    if previous not in (1, 5):
        raise UserError(f"--prev_segment_conditioning_frames {previous} must be 1 or 5 (the pipeline's choices)")
    if length - previous <= previous:
        raise UserError(
            f"--segment_frame_length {length} must exceed twice --prev_segment_conditioning_frames {previous}: "
            "WanAnimatePipeline (diffusers 0.42.1) miscounts its segments below that"
        )
    if request.num_frames <= previous:
        raise UserError(
            f"the pose video's {request.num_frames} frame(s) (--num_frames) must be more than "
            f"--prev_segment_conditioning_frames {previous}"
        )


class SegmentLoops:
    """One video's segments for stage 2: each segment's loop (from `make(conditioning, noise)`, the family's
    loop over a fresh scheduler), built as the one before finishes (`DenoiseLoop.then`), and stage 2's tensors
    from all of them."""

    def __init__(self, source, request: Request, embeds, dtype, do_cfg: bool, generator, pipeline, decoder, runtime):
        """`pipeline(**components)`: the source's pipeline object holding those (config.stock_pipeline);
        `decoder(vae)`: the family's decoder of stage-2 latents (pipeline.Decoder, with their normalisation);
        `runtime`: stage 2's, where the work between segments runs too."""
        self.source, self.request, self.embeds, self.dtype, self.do_cfg = source, request, embeds, dtype, do_cfg
        self.generator, self.pipeline, self.decoder, self.runtime = generator, pipeline, decoder, runtime
        self.noise = pipeline()  # its prepare_latents draws each segment's noise
        self.length, self.previous = segment_options(request)
        self.count = segment_count(request)[0]
        self.done: list[torch.Tensor] = []  # the finished segments' final latents
        self.make = None

    def first(self, make) -> Any:
        self.make = make
        if self.count > 1:
            log(
                f"Animate: {self.count} segments of {self.length} frames, {self.previous} carried from each to the next"
            )
        return self._loop(0, self.embeds[CONDITION])

    def _loop(self, index: int, condition: torch.Tensor):
        start = index * (self.length - self.previous)
        face = self.embeds[FACE][:, :, start : start + self.length].to(self.dtype)
        inputs = [
            (torch.cat([self.embeds[CHARACTER], condition], dim=2).float(), ()),  # joined to the latents, then cast
            (self.embeds["image_embeds"].to(self.dtype), ()),
            (self.embeds[POSE][index : index + 1].to(self.dtype), ()),
            (torch.cat([face, face * 0 - 1]) if self.do_cfg else face, BATCH),  # the pipeline's blank face
        ]
        sizes = (1, self.source.load_config("vae")["z_dim"], self.request.height, self.request.width, self.length)
        noise = self.noise.prepare_latents(*sizes, NOISE_DTYPE, "cpu", self.generator)
        loop = self.make(inputs, noise)
        more = index + 1 < self.count
        label = f"segment {index + 1} of {self.count}" if self.count > 1 else ""
        return dataclasses.replace(
            loop, then=self._next if more else None, between_plan=self._plan if more else None, label=label
        )

    def _next(self, latents: torch.Tensor):
        """The next segment's loop, conditioned on this one's decoded last frames."""
        self.done.append(latents)
        index = len(self.done)
        start = index * (self.length - self.previous)
        end = start + self.length
        segment = latents[:, :, 1:]  # the character's frame dropped, as the pipeline decodes
        pipe, decode = self._coder()
        replace = self.request.option("mode") == "replace"
        background, mask = (
            processed_pixels(self.embeds[key][:, :, start:end], key == BACKGROUND) if replace else None
            for key in (BACKGROUND, MASK)
        )
        log(f"Animate: segment {index} of {self.count} decoded, its last {self.previous} frame(s) encoded")
        with torch.no_grad(), self.runtime.attention(VAE_ATTENTION), self.runtime.precision(torch.float32):
            frames = decode(segment)
            condition = pipe.prepare_prev_segment_cond_latents(
                frames[:, :, -self.previous :], background, mask, 1, self.length, start, self.request.height,
                self.request.width, self.previous, "replace" if replace else "animate", device="cpu",
            )  # fmt: skip
        return self._loop(index, condition)

    def _shapes(self) -> tuple[tuple, tuple]:
        """(a segment's latents without the character's frame, its pixels), one video's."""
        vae = self.source.load_config("vae")
        spatial, height, width = vae["scale_factor_spatial"], self.request.height, self.request.width
        frames = latent_frames(self.source, self.request) - 1
        return (1, vae["z_dim"], frames, height // spatial, width // spatial), (1, 3, self.length, height, width)

    def _coder(self):
        """The pipeline (its condition encode) holding a stand-in VAE whose encode runs on the runtime, and the
        decode on the runtime: vae_encode.py's programs with the VAE in float32 (as the pipeline's example loads
        it), the frames split over every device. Placed once per runtime and segment size: a batch's videos
        share it (`_CODER`)."""
        latents_shape, pixels_shape = self._shapes()
        key = (self.runtime, self.source.location, latents_shape, pixels_shape)
        if _CODER.get("key") != key:
            _CODER.clear()
            layout = split_over_mesh(latents_shape, getattr(self.runtime, "mesh", None))
            vae = self.source.load("vae", dtype=torch.float32).eval()
            decode, encode = vae_encode.coder_programs(
                self.source, self.decoder(vae), latents_shape, pixels_shape, self.runtime, layout
            )
            _CODER.update(key=key, coder=(self.pipeline(vae=vae_encode.ChunkedEncoder(vae, encode)), decode))
        return _CODER["coder"]

    def _plan(self, runtime):
        """`DenoiseLoop.between_plan`: the decode and encode between two segments, as `_coder` builds them."""
        latents_shape, pixels_shape = self._shapes()
        decoder = self.decoder(meta_module(self.source, "vae", torch.float32))
        layout = split_over_mesh(latents_shape, runtime.mesh)
        return (*vae_encode.coder_plan(decoder, latents_shape, pixels_shape, runtime, layout), VAE_ATTENTION)

    def finish(self, latents: torch.Tensor, record: dict) -> tuple[dict, dict]:
        """Every segment's latents without the character's frame, one per row, and how stage 3 joins them. The
        VAE's programs between segments are let go (the devices' memory back for the next batch's steps)."""
        _CODER.clear()
        every = torch.cat([*self.done, latents])[:, :, 1:]
        joined = {"count": self.count, "overlap_frames": self.previous, "frames_kept": self.request.num_frames}
        return {"latents": every}, {**record, "segments": joined}


class GuidedAnimate(GuidedTransformer):
    """GuidedTransformer for WanAnimateTransformer3DModel: the reference joins the latents on channels, the CLIP
    tokens and the pose latents go to both branches, the face frames are each branch's. Its face adapters add
    to the video tokens after every `inject_face_latents_blocks`-th block, so the block scan takes the blocks
    between two of them (`scan_spans`)."""

    def scan_spans(self, blocks: int) -> list[tuple[int, int]]:
        every = self.transformer.config.inject_face_latents_blocks
        return spans_after(range(0, blocks, every), blocks)

    @property
    def block_streams(self):
        """What a block takes and returns, for the scan: its blocks are a copy of Wan's WanTransformerBlock in
        transformer_wan_animate.py, which diffusers 0.42.1 leaves out of its block registry; Wan's entry."""
        from diffusers.hooks._helpers import TransformerBlockRegistry
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        return TransformerBlockRegistry.get(WanTransformerBlock)

    def forward(self, latents, timestep, prompt_embeds, reference, image_embeds, pose_latents, face_pixels):
        reference = reference.expand(latents.shape[0], *reference.shape[1:])
        model_input = torch.cat([latents, reference], dim=1)

        def predict(model_input):
            def every_sample(tensor):  # one per video, or one for all (the same in every video of a batch)
                return tensor.repeat(model_input.shape[0] // len(tensor), *[1] * (tensor.dim() - 1))

            return self.transformer(
                hidden_states=model_input,
                timestep=timestep.expand(model_input.shape[0]),
                encoder_hidden_states=prompt_embeds,
                encoder_hidden_states_image=every_sample(image_embeds),
                pose_hidden_states=every_sample(pose_latents),
                face_pixel_values=face_pixels,
                return_dict=False,
            )[0]

        combine = functools.partial(cfg_combination, guidance_scale=self.guidance_scale)
        return self.guided(model_input.to(self.dtype), predict, combine)
