"""What the stages' parsers read of Wan, importing no torch: its name, pipeline classes, options, media inputs
(image-to-video's frames, video-to-video's video, VACE's control video, mask and reference images, Animate's
character image, pose, face, background and mask videos) and tiny presets (the package's other members load
on first use: models.family.lazy_members)."""

from __future__ import annotations

import functools

from tpu_video.cli.options import Option
from tpu_video.engine.inputs import MediaInput, image_input, video_input
from tpu_video.engine.videos import read_image_or_video, read_video

from ..common import IMAGE, LAST_IMAGE
from ..family import Preset, preset_builder

NAME = "wan"
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline")
# --scheduler's names for the flow-matching samplers a Wan folder's scheduler config can build.
SCHEDULERS = ("unipc", "euler")
DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline.__call__'s
ANIMATE_MODES = ("animate", "replace")
SEGMENT_FRAMES = 77  # WanAnimatePipeline.__call__'s segment_frame_length
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
    Option(
        "mode",
        "str",
        "Wan Animate: animate the --image character with the pose and face videos' motion, or replace the person "
        "of --background_video (where --mask_video is white) with it (default animate, the pipeline's)",
        choices=ANIMATE_MODES,
        later=False,  # stage 1 encoded the inputs for it
        with_input="pose_video",
        input_default="animate",
    ),
    Option(
        "segment_frame_length",
        "int",
        f"Wan Animate: the frames the transformer denoises at once, 4n+1 (default {SEGMENT_FRAMES}, the pipeline's)",
        later=False,  # stage 1 encoded the inputs for it
        with_input="pose_video",
        input_default=SEGMENT_FRAMES,
    ),
    Option(
        "prev_segment_conditioning_frames",
        "int",
        "Wan Animate: how many of a segment's last frames condition the next, 1 or 5 (default 1, the pipeline's)",
        later=False,  # stage 1 encoded the inputs for it
        with_input="pose_video",
        input_default=1,
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

ANIMATE_TASK = "animate"
POSE_VIDEO = video_input(
    "pose_video",
    "Wan Animate: the pose video (rendered skeletons) whose motion the --image character follows; its frames "
    "are the video's",
    task=ANIMATE_TASK,
)
FACE_VIDEO = MediaInput(
    "face_video",
    "Wan Animate: the face video (the driving face, cropped), as many frames as --pose_video",
    read_video,
    kind="face video",  # read at the motion encoder's size, not the video's
    task=ANIMATE_TASK,
    timed=True,
)
BACKGROUND_VIDEO = video_input(
    "background_video", "Wan Animate, --mode replace: the video whose person the character replaces", ANIMATE_TASK
)
MASK_VIDEO = video_input(
    "mask_video",
    "Wan Animate, --mode replace: where --background_video is redrawn (white) and kept (black)",
    ANIMATE_TASK,
)
CHARACTER = image_input(
    "image", "Wan Animate: the character", "is Wan Animate: give the character with --image PATH", ANIMATE_TASK
)
ANIMATE_INPUTS = (
    POSE_VIDEO.required_here(),
    FACE_VIDEO.required_here(),
    CHARACTER.required_here(),
    BACKGROUND_VIDEO,
    MASK_VIDEO,
)
MEDIA_INPUTS = (IMAGE, LAST_IMAGE, VIDEO, *VACE_INPUTS, POSE_VIDEO, FACE_VIDEO, BACKGROUND_VIDEO, MASK_VIDEO)

_built = functools.partial(preset_builder, f"{__package__}.presets")
TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 16, "num_inference_steps": 6}
PRESETS = {
    "tiny-wan2.1": Preset(NAME, _built("tiny_pipeline", "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2": Preset(NAME, _built("tiny_pipeline", "2.2"), TINY_DEFAULTS),
    "tiny-wan2.1-i2v": Preset(NAME, _built("tiny_i2v_pipeline", "2.1"), TINY_DEFAULTS),
    "tiny-wan2.2-i2v": Preset(NAME, _built("tiny_i2v_pipeline", "2.2"), TINY_DEFAULTS),
    "tiny-wan2.1-vace": Preset(NAME, _built("tiny_vace_pipeline"), TINY_DEFAULTS),
    "tiny-wan2.2-animate": Preset(NAME, _built("tiny_animate_pipeline"), {**TINY_DEFAULTS, "fps": 30}),
    # TI2V-5B's layout; sizes are multiples of 32 (16x VAE, 2x2 patches)
    "tiny-wan2.2-ti2v": Preset(NAME, _built("tiny_ti2v_pipeline"), {**TINY_DEFAULTS, "height": 64, "width": 96}),
}
