"""What the stages' parsers read of Wan, importing no torch: its name, pipeline classes, options, media inputs
(image-to-video's frames, video-to-video's video, VACE's control video, mask and reference images) and tiny
presets (the package's other members load on first use: models.family.lazy_members)."""

from __future__ import annotations

import functools

from tpu_video.cli.options import Option
from tpu_video.engine.inputs import MediaInput, image_input, video_input
from tpu_video.engine.videos import read_image_or_video

from ..common import IMAGE, LAST_IMAGE
from ..family import Preset, preset_builder

NAME = "wan"
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline")
# --scheduler's names for the flow-matching samplers a Wan folder's scheduler config can build.
SCHEDULERS = ("unipc", "euler")
DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline.__call__'s
OPTIONS = (
    Option(
        "guidance_scale_2",
        "float",
        "Wan 2.2 A14B: guidance scale of the low-noise expert (default: --guidance_scale)",
    ),
    Option(
        "scheduler",
        "str",
        "the sampler, built from the model folder's scheduler config (default: the folder's, UniPC in the "
        "published ones; the 4-step distillation LoRAs expect euler, docs/lora.md)",
        choices=SCHEDULERS,
    ),
    Option(
        "strength",
        "float",
        "video-to-video (--video): how much of the schedule runs from the video's noised latents, above 0 to 1 "
        f"(default {DEFAULT_STRENGTH}, the pipeline's)",
        with_input="video",
        input_default=DEFAULT_STRENGTH,
    ),
    Option(
        "conditioning_scale",
        "floats",
        "Wan VACE: how strongly the control steers, one number or one per VACE layer (default 1.0, the pipeline's)",
        metavar="SCALE",
    ),
)

VIDEO = video_input(
    "video",
    "video-to-video: the video to restyle (a video file ffmpeg reads, or a folder of frame images), on Wan "
    "text-to-video models; --strength says how much is redrawn",
    frame_step=4,  # the Wan VAE encodes 4n+1 frames
)

VACE_TASK = "vace"


CONTROL_VIDEO = video_input(
    "control_video",
    "Wan VACE: the control video (a depth, pose or edge video, or the video to inpaint; a file ffmpeg reads or "
    "a folder of frames), kept where --mask is black and redrawn where it is white",
    task=VACE_TASK,
    frame_step=4,  # the Wan VAE encodes 4n+1 frames
)
MASK = MediaInput(
    "mask",
    "Wan VACE: with --control_video, where to redraw it (white) and where to keep it (black): a video of at "
    "least as many frames as the run takes, or one image for every frame",
    read_image_or_video,  # one image: the same mask on every frame
    kind="mask",
    task=VACE_TASK,
    timed=True,
)
REFERENCE_IMAGES = image_input(
    "reference_images",
    "Wan VACE: one or more images of a subject or style to keep (prepended as frames, then dropped)",
    task=VACE_TASK,
    many=True,
)
VACE_INPUTS = (CONTROL_VIDEO, MASK, REFERENCE_IMAGES)
MEDIA_INPUTS = (IMAGE, LAST_IMAGE, VIDEO, *VACE_INPUTS)

_built = functools.partial(preset_builder, f"{__package__}.presets")
TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 16, "num_inference_steps": 6}
PRESETS = {
    "tiny-wan2.1": Preset(NAME, _built("tiny_pipeline", "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2": Preset(NAME, _built("tiny_pipeline", "2.2"), TINY_DEFAULTS),
    "tiny-wan2.1-i2v": Preset(NAME, _built("tiny_i2v_pipeline", "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2-i2v": Preset(NAME, _built("tiny_i2v_pipeline", "2.2"), TINY_DEFAULTS),
    "tiny-wan2.1-vace": Preset(NAME, _built("tiny_vace_pipeline"), TINY_DEFAULTS),
    # TI2V-5B's layout; sizes are multiples of 32 (16x VAE, 2x2 patches)
    "tiny-wan2.2-ti2v": Preset(NAME, _built("tiny_ti2v_pipeline"), {**TINY_DEFAULTS, "height": 64, "width": 96}),
}
