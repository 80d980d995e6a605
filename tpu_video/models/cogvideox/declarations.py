"""What the stages' parsers read of CogVideoX, importing no torch: its name, pipeline classes, options, media
inputs and tiny presets (the package's other members load on first use: models.family.lazy_members)."""

from __future__ import annotations

import functools

from ..common import IMAGE
from ..family import Preset, preset_builder

NAME = "cogvideox"
I2V_PIPELINE_CLASS = "CogVideoXImageToVideoPipeline"
PIPELINE_CLASSES = ("CogVideoXPipeline", I2V_PIPELINE_CLASS)
OPTIONS = ()  # no options of its own (family.Family.OPTIONS)
MEDIA_INPUTS = (IMAGE,)

TINY_DEFAULTS = {"height": 64, "width": 96, "num_frames": 9, "fps": 8, "num_inference_steps": 8}
_built = functools.partial(preset_builder, f"{__package__}.presets")
PRESETS = {
    "tiny-cogvideox": Preset(NAME, _built("tiny_pipeline", "1.5"), TINY_DEFAULTS),
    "tiny-cogvideox1.0": Preset(NAME, _built("tiny_pipeline", "1.0"), TINY_DEFAULTS),
    "tiny-cogvideox-i2v": Preset(NAME, _built("tiny_pipeline", "1.5", image_to_video=True), TINY_DEFAULTS),
    "tiny-cogvideox1.0-i2v": Preset(NAME, _built("tiny_pipeline", "1.0", image_to_video=True), TINY_DEFAULTS),
}
