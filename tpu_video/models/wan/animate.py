"""Wan Animate (`WanAnimatePipeline`, `WanAnimateTransformer3DModel`): a character image moved by a pose video
and a face video (`--mode animate`), or put in place of the person of a background video where a mask video is
white (`--mode replace`).

The pipeline denoises the video in segments of `segment_frame_length` frames, each after the first conditioned
on the last frames of the one before (decoded and VAE-encoded again inside its loop). This build runs one
segment: pose videos of at most `segment_frame_length` frames (padded to it as the pipeline pads them, the
output cut back to the pose video's length); a longer one is refused before anything loads.

Stage 1 runs the pipeline's own preprocessing and encodes on the host CPU in float32 (as its example loads the
VAE): the character's CLIP tokens (`image_embeds`), its VAE latents behind the image-to-video mask with the
segment's condition latents behind theirs (`animate_reference`: zeros, or the background outside the mask),
the pose video's VAE latents (`pose_latents`) and the face video's pixels at the motion encoder's size
(`face_pixels`). Stage 2 draws one more latent frame than the segment has (the reference's), concatenates the
reference on channels each step, runs the unconditional branch with the face blanked to -1 (the pipeline's
guidance, off at its default scale 1) and drops that frame at the end; stage 3 decodes the segment and keeps the
pose video's frames (`frames_kept`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.guidance import BATCH, cfg_combination
from utils import Request

from .declarations import SEGMENT_FRAMES
from .transformer import GuidedTransformer, spans_after

REFERENCE = "animate_reference"  # [i2v mask, latents] on channels; the character's frame, then the segment's
POSE = "pose_latents"
FACE = "face_pixels"
DEFAULTS = {"height": 720, "width": 1280, "fps": 30, "num_inference_steps": 20, "guidance_scale": 1.0}


def is_animate(source) -> bool:
    return source.index.get("_class_name") == "WanAnimatePipeline"


def segment(request: Request) -> tuple[int, int]:
    """(segment_frame_length, prev_segment_conditioning_frames) as the request sets them."""
    length = request.option("segment_frame_length")
    previous = request.option("prev_segment_conditioning_frames")
    return (SEGMENT_FRAMES if length is None else length), (1 if previous is None else previous)


def latent_frames(source, request: Request) -> int:
    """The transformer's frames: the segment's latent frames and the character's one before them."""
    return (segment(request)[0] - 1) // source.load_config("vae")["scale_factor_temporal"] + 2


def check_request(source, request: Request) -> None:
    """The segment options, and one segment's worth of frames (the pose video's: --num_frames)."""
    length, previous = segment(request)
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
            f"--num_frames {request.num_frames}: the pose video must have more frames than "
            f"--prev_segment_conditioning_frames {previous}"
        )
    if request.num_frames > length:
        fits = (request.num_frames - 1 + temporal - 1) // temporal * temporal + 1
        raise UserError(
            f"--pose_video: {request.num_frames} frames make more than one segment of --segment_frame_length "
            f"{length}; this build runs one segment: give --segment_frame_length {fits} (the frames x height x "
            f"width the transformer holds at once) or --num_frames {length} (the pose video's first frames)"
        )


def check_inputs(source, request: Request, inputs: dict[str, Any]) -> None:
    """Before any weights load: pose and face videos of one length, and the background and mask videos with
    --mode replace only, of that length too."""
    mode = request.option("mode") or "animate"
    pose = len(inputs["pose_video"])
    named = {name: inputs[name] for name in ("face_video", "background_video", "mask_video") if name in inputs}
    for name, frames in named.items():
        if len(frames) != pose:
            raise UserError(
                f"--{name} has {len(frames)} frames and --pose_video {pose}: give videos of the same length (the "
                "preprocessing that makes them from one driving video does)"
            )
    replace = [name for name in ("background_video", "mask_video") if name in inputs]
    if mode == "replace" and len(replace) < 2:
        raise UserError("--mode replace: give --background_video and --mask_video (the person to replace, where)")
    if mode == "animate" and replace:
        raise UserError(f"--{replace[0]}: only --mode replace uses it (--mode is animate)")


def encode(source, request: Request, inputs: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's conditioning for the first segment, by its own methods, in float32 on the host CPU."""
    from diffusers import WanAnimatePipeline

    from tpu_video.engine.encoders import DeviceImageEncoder
    from tpu_video.engine.meta import meta_module

    length, previous = segment(request)
    mode = request.option("mode") or "animate"
    height, width, frames = request.height, request.width, request.num_frames
    pipe = WanAnimatePipeline(
        tokenizer=None,
        text_encoder=None,
        vae=source.load("vae", dtype=torch.float32).eval(),
        scheduler=None,
        image_processor=source.load("image_processor"),
        image_encoder=DeviceImageEncoder(source.load("image_encoder", dtype=torch.float32).eval(), runtime),
        transformer=meta_module(source, "transformer", torch.float32),  # the pipeline reads its patch and face sizes
    )
    face_size = pipe.transformer.config.motion_encoder_size
    log(
        f"Animate ({mode}): the character and {frames} pose frames (padded to the {length}-frame segment) "
        f"VAE-encoded on the host CPU at {height}x{width}; the face frames resized to {face_size}x{face_size}"
    )

    def video(name, processor=pipe.video_processor, size=(height, width)):
        padded = pipe.pad_video_frames(inputs[name][:frames], length)
        return processor.preprocess_video(padded, height=size[0], width=size[1]).float()

    with torch.no_grad():
        image = inputs["image"]
        pixels = pipe.vae_image_processor.preprocess(image, height=height, width=width, resize_mode="fill").float()
        character = pipe.prepare_reference_image_latents(pixels, 1, device="cpu")
        background = mask = None
        if mode == "replace":
            background, mask = video("background_video"), video("mask_video", pipe.video_processor_for_mask)
        condition = pipe.prepare_prev_segment_cond_latents(
            None, background, mask, 1, length, 0, height, width, previous, mode, device="cpu"
        )
        return {
            "image_embeds": pipe.encode_image(image, "cpu").float(),
            REFERENCE: torch.cat([character, condition], dim=2),
            POSE: pipe.prepare_pose_latents(video("pose_video"), 1, device="cpu"),
            FACE: video("face_video", size=(face_size, face_size)),
        }


def planning_embeds(source, request: Request) -> dict[str, torch.Tensor]:
    """Zeros of stage 1's Animate tensors' shapes (to plan before encoding)."""
    vae, transformer = source.load_config("vae"), source.load_config("transformer")
    spatial, frames = vae["scale_factor_spatial"], latent_frames(source, request)
    grid = (request.height // spatial, request.width // spatial)
    vision = source.load_config("image_encoder")
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + 1  # CLIP: patches and the class token
    face = transformer["motion_encoder_size"]
    return {
        "image_embeds": torch.zeros(1, tokens, transformer["image_dim"]),
        REFERENCE: torch.zeros(1, vae["scale_factor_temporal"] + vae["z_dim"], frames, *grid),  # mask, latents
        POSE: torch.zeros(1, vae["z_dim"], frames - 1, *grid),
        FACE: torch.zeros(1, 3, segment(request)[0], face, face),
    }


def loop_inputs(embeds: dict, dtype: torch.dtype, do_cfg: bool) -> list[tuple[torch.Tensor, tuple]]:
    """The guided transformer's inputs after the prompt: the reference (float32, joined to the latents before
    the cast, as the pipeline does), the CLIP tokens and pose latents in the transformer's dtype, and the face
    frames per branch (the unconditional branch's blanked to -1, the pipeline's `face * 0 - 1`)."""
    face = embeds[FACE].to(dtype)
    faces = torch.cat([face, face * 0 - 1]) if do_cfg else face
    return [
        (embeds[REFERENCE].float(), ()),
        (embeds["image_embeds"].to(dtype), ()),
        (embeds[POSE].to(dtype), ()),
        (faces, BATCH),
    ]


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
            copies = model_input.shape[0] // len(image_embeds)  # both branches (a batch: each video's, in order)
            return self.transformer(
                hidden_states=model_input,
                timestep=timestep.expand(model_input.shape[0]),
                encoder_hidden_states=prompt_embeds,
                encoder_hidden_states_image=image_embeds.repeat(copies, 1, 1),
                pose_hidden_states=pose_latents.repeat(copies, 1, 1, 1, 1),
                face_pixel_values=face_pixels,
                return_dict=False,
            )[0]

        combine = functools.partial(cfg_combination, guidance_scale=self.guidance_scale)
        return self.guided(model_input.to(self.dtype), predict, combine)
