"""What the stages' parsers read of HunyuanVideo-1.5, importing no torch: its name, pipeline classes, options,
media inputs and tiny presets (the package's other members load on first use: models.family.lazy_members)."""

from __future__ import annotations

import functools

from ..common import IMAGE
from ..family import Preset, preset_builder

NAME = "hunyuanvideo15"
I2V_PIPELINE_CLASS = "HunyuanVideo15ImageToVideoPipeline"
PIPELINE_CLASSES = ("HunyuanVideo15Pipeline", I2V_PIPELINE_CLASS)
OPTIONS = ()  # no options of its own (family.Family.OPTIONS)
MEDIA_INPUTS = (IMAGE,)

_built = functools.partial(preset_builder, f"{__package__}.presets")
TINY_DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "fps": 24, "num_inference_steps": 4, "flow_shift": 5.0}
# The pipeline pads the Qwen2.5-VL prompt to 1000 tokens, the ByT5 glyph text to 256 and text-to-video's
# zero image tokens to 729, all masked out of attention. The tiny presets pad to less: a sequence of about
# 570 tokens instead of 2,000 (the suite's HunyuanVideo-1.5 tests take about a fifth less time), the same
# result for a prompt that fits. The in-code tokenizer is byte-level and the chat template's crop leaves
# 398 of its bytes, so 512 tokens hold a prompt of up to 114 bytes; a longer one is cut there, as the
# pipeline with these lengths cuts it.
TINY_LENGTHS = {"tokenizer_max_length": 512, "tokenizer_2_max_length": 32, "vision_num_semantic_tokens": 16}
PRESETS = {
    "tiny-hunyuanvideo15": Preset(NAME, _built("tiny_pipeline"), TINY_DEFAULTS, TINY_LENGTHS),
    # image-to-video: the size comes from the image (i2v.size_from_inputs)
    "tiny-hunyuanvideo15-i2v": Preset(NAME, _built("tiny_pipeline", image_to_video=True), TINY_DEFAULTS, TINY_LENGTHS),
    # the step-distilled image-to-video checkpoint's layout: meanflow (a second timestep), shift 7, guidance 1
    "tiny-hunyuanvideo15-i2v-step-distilled": Preset(
        NAME,
        _built("tiny_pipeline", image_to_video=True, step_distilled=True),
        {**TINY_DEFAULTS, "flow_shift": 7.0},
        TINY_LENGTHS,
    ),
}
