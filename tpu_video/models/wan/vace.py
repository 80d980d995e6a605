"""Wan VACE (`WanVACEPipeline`, `WanVACETransformer3DModel`): a control video split by a mask into the part
to keep and the part to redraw, and reference images, steer a Wan 2.1 text-to-video transformer through
its VACE blocks, whose hints join the main blocks at `vace_layers` (scaled by `--conditioning_scale`).

Stage 1 runs the pipeline's own preprocessing in float32 (its example loads the VAE in float32; the VAE's
encodes run on the runtime one chunk of frames per call, vae_encode.py): `preprocess_conditions` (the control
video at its own size, the mask thresholded, the reference images letterboxed on white), `prepare_video_latents`
(the VAE latents of the kept and redrawn parts, each reference image's latents prepended as a frame) and
`prepare_masks` (the mask rearranged 8 x 8 into channels, interpolated to the latent frames): `vace_control`, as
the transformer takes it. Without a control video the pipeline conditions on a zero video and a mask of ones
(only the references steer). Stage 2 draws noise for the reference frames too and drops them at the end, as the
pipeline does before its decode.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sharding import DP, SP
from tpu_video.attention.calls import mark_cross_attention
from tpu_video.cli import UserError, log
from tpu_video.engine.guidance import cfg_combination
from utils import Request

from ..common import constrain_block_inputs
from .transformer import BLOCK_INPUTS, GuidedTransformer, spans_after
from .vae_encode import device_encoder

CONTROL = "vace_control"  # stage 1's tensor: [inactive latents, reactive latents, mask] on channels


def is_vace(source) -> bool:
    return source.index.get("_class_name") == "WanVACEPipeline"


def layer_scales(source, request: Request, transformer) -> list[float]:
    """--conditioning_scale as one value per VACE layer of `transformer` (the pipeline's expansion of a single
    number; a plan's shallower transformer keeps the scales of the layers it has)."""
    layers = source.load_config("transformer")["vace_layers"]
    given = request.option("conditioning_scale") or [1.0]
    scales = dict(zip(layers, list(given) * len(layers) if len(given) == 1 else given, strict=True))
    return [scales[layer] for layer in transformer.config.vace_layers]


def check_request(source, request: Request) -> None:
    """--conditioning_scale: VACE models only; one value, or one per VACE layer."""
    given = request.option("conditioning_scale")
    if given is None:
        return
    if not is_vace(source):
        raise UserError("--conditioning_scale applies to Wan VACE models (WanVACEPipeline); this one is not")
    layers = source.load_config("transformer")["vace_layers"]
    if len(given) not in (1, len(layers)):
        raise UserError(
            f"--conditioning_scale takes one value or one per VACE layer ({len(layers)}: layers {layers}); "
            f"{len(given)} given"
        )


def control_size(source, frame, wanted: tuple[int, int]) -> tuple[int, int]:
    """The size the pipeline conditions on a control video of this first frame for a request of size
    `wanted` (height, width): its own (from the video processor), shrunk to fit the request when its area is
    larger, floored to the patch grid (preprocess_conditions)."""
    from diffusers.video_processor import VideoProcessor

    spatial = source.load_config("vae")["scale_factor_spatial"]
    base = spatial * source.load_config("transformer")["patch_size"][1]
    height, width = VideoProcessor(vae_scale_factor=spatial).get_default_height_width(frame)
    if height * width > wanted[0] * wanted[1]:
        scale = min(wanted[1] / width, wanted[0] / height)
        height, width = int(height * scale), int(width * scale)
    return height // base * base, width // base * base


def check_inputs(source, request: Request, inputs: dict[str, Any]) -> None:
    """Before any weights load: something to steer by, a mask with its control video and of its length, a
    control video the pipeline conditions at the requested size, and room for the reference frames in the
    rotary embedding."""
    if not inputs:
        raise UserError(
            f"--model {request.model_id!r} is a Wan VACE model: give --control_video (with --mask), "
            "--reference_images, or both (for the prompt alone use a text-to-video Wan model)"
        )
    video, mask = inputs.get("control_video"), inputs.get("mask")
    if mask is not None and video is None:
        raise UserError("--mask: a mask says where to redraw a --control_video; give the video too")
    if mask is not None and len(mask) != 1 and len(mask) < request.num_frames:
        raise UserError(
            f"--mask has {len(mask)} frames; the run takes {request.num_frames} of --control_video: give a mask "
            "video of at least as many frames, or one image for every frame"
        )
    if video is not None:
        size = control_size(source, video[0], (request.height, request.width))
        if size != (request.height, request.width):
            own = (video[0].height, video[0].width)
            fix = (
                f"give --height {own[0]} --width {own[1]}, its own size, or "
                if control_size(source, video[0], own) == own
                else ""
            )
            raise UserError(
                f"--control_video: WanVACEPipeline conditions on this {own[0]}x{own[1]} video (height x width) at "
                f"{size[0]}x{size[1]} (its own size, shrunk to fit the request when larger, floored to the patch "
                f"grid), not at the requested {request.height}x{request.width}, so the control would not line up: "
                f"{fix}resize the video to {request.height}x{request.width}"
            )
    references = len(inputs.get("reference_images") or ())
    if references > latent_frames(source, request):
        # diffusers 0.42.1's prepare_masks pads the mask with a slice of its own latent frames, one per
        # reference image: past that count the pipeline fails. Remove this refusal when
        # tests/test_upstream_bugs.py::test_diffusers_0_42_1_vace_fails_past_one_reference_image_per_latent_frame
        # fails (diffusers then pads by the count) and compare such a run with the pipeline.
        raise UserError(
            f"--reference_images: {references} images, more than the {latent_frames(source, request)} latent "
            f"frames of {request.num_frames} frames; WanVACEPipeline (diffusers 0.42.1) takes at most that many"
        )
    positions = source.load_config("transformer").get("rope_max_seq_len", 1024)
    frames = latent_frames(source, request) + references
    if references and frames > positions:
        raise UserError(
            f"--reference_images: {references} reference frames and {latent_frames(source, request)} latent "
            f"frames make {frames} positions along time, more than the {positions} the transformer's rotary "
            "embedding holds (rope_max_seq_len)"
        )


def latent_frames(source, request: Request) -> int:
    return (request.num_frames - 1) // source.load_config("vae")["scale_factor_temporal"] + 1


def encode(source, request: Request, inputs: dict[str, Any], runtime) -> dict[str, torch.Tensor]:
    """The pipeline's conditioning, by its own methods, in float32 (the VAE on `runtime`, 4 frames per program
    call: vae_encode.py): `vace_control`."""
    from diffusers import WanVACEPipeline

    from tpu_video.engine.meta import meta_module

    frames = request.num_frames
    video = inputs.get("control_video")
    mask = inputs.get("mask")
    if mask is not None and len(mask) == 1:
        mask = mask * frames  # one image: the mask of every frame
    vae = source.load("vae", dtype=torch.float32).eval()
    transformer = meta_module(source, "transformer", torch.float32)  # the pipeline reads its patch size
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=None, transformer=transformer)
    pipe.vae = device_encoder(source, vae, runtime, request.height, request.width)  # after __init__ read the VAE
    what = [f"{frames} control frames" if video is not None else "a zero control video (no --control_video)"]
    what += [f"{len(inputs['reference_images'])} reference image(s)"] if inputs.get("reference_images") else []
    log(f"VACE: {' and '.join(what)} VAE-encoded at {request.height}x{request.width}")
    size = f"{request.height}x{request.width}"
    for name, given in (("control_video", video), ("mask", mask)):
        if given is not None and given[0].size != (request.width, request.height):
            log(f"--{name}: its {given[0].height}x{given[0].width} frames are resized to {size}")
    for index, image in enumerate(inputs.get("reference_images") or (), 1):
        if abs(image.width / image.height - request.width / request.height) > 0.01 * request.width / request.height:
            log(
                f"--reference_images: image {index} ({image.height}x{image.width}, height x width) is fitted into "
                f"{request.height}x{request.width} keeping its aspect ratio, on white (the pipeline's letterbox)"
            )
    with torch.no_grad():
        video, mask, references = pipe.preprocess_conditions(
            None if video is None else video[:frames],
            None if mask is None else mask[:frames],
            inputs.get("reference_images"),
            1,
            request.height,
            request.width,
            frames,
            torch.float32,
            "cpu",
        )
        latents = pipe.prepare_video_latents(video, mask, references, None, "cpu")
        masks = pipe.prepare_masks(mask, references, None)
    return {CONTROL: torch.cat([latents, masks], dim=1)}


def planning_control(source, request: Request) -> torch.Tensor:
    """Zeros of stage 1's `vace_control` shape without reference images (to plan before encoding)."""
    vae = source.load_config("vae")
    spatial = vae["scale_factor_spatial"]
    channels = source.load_config("transformer")["vace_in_channels"]
    return torch.zeros(1, channels, latent_frames(source, request), request.height // spatial, request.width // spatial)


def loop_inputs(source, request: Request, embeds: dict, dtype, transformer) -> tuple[list, int]:
    """The guided transformer's extra inputs (`vace_control` and the per-layer scales, in the transformer's
    dtype as the pipeline casts them, replicated) and how many reference frames stage 1 prepended."""
    scales = torch.tensor(layer_scales(source, request, transformer)).to(dtype)
    return [(embeds[CONTROL].to(dtype), ()), (scales, ())], reference_frames(source, request, embeds)


def reference_frames(source, request: Request, embeds: dict) -> int:
    """How many reference images stage 1 prepended (the control's latent frames beyond the video's)."""
    control = embeds[CONTROL]
    count = control.shape[2] - latent_frames(source, request)
    if count < 0:
        raise UserError(f"the stage-1 VACE control has {control.shape[2]} latent frames; this request needs more")
    return count


class GuidedVACE(GuidedTransformer):
    """GuidedTransformer for WanVACETransformer3DModel: the control latents and the per-layer scales go to
    both branches, as the pipeline passes them to both calls. Its VACE blocks are marked and pinned as the
    main ones. The block scan takes the main blocks between two hints (`scan_spans`), with `--scan_blocks on`
    only: the scans keep more hints live at once than the unrolled program, where XLA computes each VACE block
    just before its hint is added (14B at 720x1280x81 on v6e-8: 20.57 against 14.23 GiB per device; on v5e-8
    20.76 GiB, which does not fit, against 13.83; docs/planning.md)."""

    scan_when_asked = "the scans hold more VACE hints at once: 6.3 GiB more per device for the 14B at 720p"

    def scan_spans(self, blocks: int) -> list[tuple[int, int]]:
        """The runs of main blocks [first, end) the stock forward adds no hint inside: a hint is added after
        block i for i in vace_layers, so each span ends with a hinted block (its blocks after the first hand
        their input on, and the hint lands on the span's output) or with the last block."""
        return spans_after(self.transformer.config.vace_layers, blocks)

    def __init__(self, transformer, dtype, do_cfg, guidance_scale, constrain=None, per_token=False, barrier=None):
        super().__init__(transformer, dtype, do_cfg, guidance_scale, constrain, per_token, barrier)
        for block in transformer.vace_blocks:
            mark_cross_attention(block.attn2)
        if constrain is not None:  # (hidden, prompt, control tokens, modulation) as the main blocks' inputs
            specs = {0: BLOCK_INPUTS[0], 1: BLOCK_INPUTS[1], 2: (DP, SP, None), 3: BLOCK_INPUTS[2]}
            constrain_block_inputs(transformer.vace_blocks, constrain, specs)

    def forward(self, latents, timestep, prompt_embeds, control, control_scale):
        def predict(model_input):
            return self.transformer(
                hidden_states=model_input,
                timestep=timestep.expand(model_input.shape[0]),
                encoder_hidden_states=prompt_embeds,
                control_hidden_states=control.repeat(model_input.shape[0] // len(control), 1, 1, 1, 1),
                control_hidden_states_scale=control_scale,
                return_dict=False,
            )[0]

        combine = functools.partial(cfg_combination, guidance_scale=self.guidance_scale)
        return self.guided(latents.to(self.dtype), predict, combine)
