"""What the stages' parsers read of LTX-2, importing no torch: its name, pipeline classes, options (its
guidance terms, the distilled and refine schedules), media inputs and tiny presets (the package's other members
load on first use: models.family.lazy_members)."""

from __future__ import annotations

import functools

from tpu_video.cli.options import Option
from tpu_video.engine.inputs import MediaInput
from tpu_video.engine.videos import read_image_or_video

from ..common import IMAGE
from ..family import Preset, preset_builder

NAME = "ltx2"
PIPELINE_CLASSES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")
CONDITION_TASK = "conditions"
# The pipelines' H.264 quality for a conditioning image (diffusers' resolve_default_image_crf): 33 through
# LTX-2.3 (Gemma 3), 18 for LTX-2.5 (Gemma 4).
IMAGE_CRF, LTX2_5_IMAGE_CRF = 33, 18


def text_encoder_class(source) -> str | None:
    """The text encoder's class as model_index.json names it (Gemma 3 through LTX-2.3, Gemma 4 from LTX-2.5)."""
    return (source.index.get("text_encoder") or [None, None])[1]


def image_crf(source) -> int:
    """--image_crf's default for the checkpoint."""
    return LTX2_5_IMAGE_CRF if text_encoder_class(source) == "Gemma4UnifiedForConditionalGeneration" else IMAGE_CRF


# LTX2ConditionPipeline's conditions (LTX2VideoCondition): images or clips placed at latent frames of a
# text-to-video checkpoint's video (keyframes, first and last frame, a video extended).
CONDITION = MediaInput(
    "condition",
    "LTX-2 text-to-video models: one or more images or clips (a video file ffmpeg reads, or a folder of frames) the "
    "video is conditioned on, each placed at its --condition_index with its --condition_strength "
    "(LTX2ConditionPipeline: keyframes, first and last frame, extending a video)",
    read_image_or_video,
    kind="image or video",
    task=CONDITION_TASK,
    many=True,
    timed=True,
)
MEDIA_INPUTS = (IMAGE, CONDITION)

# The distilled step schedule (diffusers' pipelines/ltx2/utils.py: DISTILLED_SIGMA_VALUES, 8 sigmas): the
# distilled weights, or the dev weights with the distilled LoRA, run it with one pass per step, guidance off (as
# Lightricks' distilled pipeline does; diffusers' own example sets guidance_scale 1 alone, which leaves the audio
# CFG and the modality pass on: given as flags, they run).
DISTILLED_STEPS = 8
# The refine after the x2 latent upsampler (STAGE_2_DISTILLED_SIGMA_VALUES, 3 sigmas): it starts from given
# latents renoised with its first sigma and takes the sigmas as they are (diffusers' two-stage example rebuilds
# the scheduler with use_dynamic_shifting=False and shift_terminal=None for it).
REFINE_STEPS, REFINE_NOISE_SCALE = 3, 0.909375
GUIDANCE_OFF = {
    "guidance_scale": 1.0,
    "audio_guidance_scale": 1.0,
    "stg_scale": 0.0,
    "audio_stg_scale": 0.0,
    "modality_scale": 1.0,
    "audio_modality_scale": 1.0,
}
# LTX-2's guidance terms and motion speed, named as LTX2Pipeline's arguments (docs/ltx2.md). Unset, a term
# takes the pipeline's default (guidance.DEFAULTS) and is skipped where it cannot act; a value given that
# cannot act is an error.
OPTIONS = (
    *(
        Option(name, "float", words)
        for name, words in (
            ("stg_scale", "spatio-temporal guidance scale (default 1.0; acts on models with perturbed attention)"),
            (
                "modality_scale",
                "modality guidance scale (default 3.0; > 1 runs the pass without audio<->video attention)",
            ),
            ("guidance_rescale", "rescale of the guided prediction toward the conditional one's std (default 0.7)"),
            ("audio_guidance_scale", "the audio stream's --guidance_scale (default 7.0; 0 means 0)"),
            ("audio_stg_scale", "the audio stream's --stg_scale (default 1.0)"),
            ("audio_modality_scale", "the audio stream's --modality_scale (default 3.0)"),
            ("audio_guidance_rescale", "the audio stream's --guidance_rescale (default 0.7)"),
            ("motion_speed", "motion relative to real time: RoPE sees fps / motion_speed (default 1.0)"),
        )
    ),
    Option(
        "stg_blocks",
        "str",
        "comma-separated transformer blocks whose self-attention the STG pass perturbs (default: 28)",
    ),
    Option(
        "sigmas",
        "str",
        f"distilled: the {DISTILLED_STEPS} sigmas of the distilled weights (or the dev weights with the distilled "
        "LoRA); sets --num_inference_steps and turns every guidance scale not given off (one pass per step); "
        f"distilled_refine: the {REFINE_STEPS} sigmas of the two-stage pipeline's refine, a pass from given latents "
        f"(--start_latents), as distilled and with --noise_scale {REFINE_NOISE_SCALE} --sigma_shift none "
        "(default: the pipeline's, --num_inference_steps evenly spaced)",
        choices=("distilled", "distilled_refine"),
        implies={
            "distilled": {"num_inference_steps": DISTILLED_STEPS, **GUIDANCE_OFF},
            "distilled_refine": {
                "num_inference_steps": REFINE_STEPS,
                **GUIDANCE_OFF,
                "noise_scale": REFINE_NOISE_SCALE,
                "sigma_shift": "none",
            },
        },
    ),
    Option(
        "sigma_shift",
        "str",
        "none: the sigmas as given, the scheduler's dynamic shift and terminal stretch off (diffusers' two-stage "
        "refine) (default: the scheduler config's)",
        choices=("none",),
    ),
    Option(
        "noise_scale",
        "float",
        "a pass from given latents (--start_latents) starts from noise_scale x noise + (1 - noise_scale) x latents, "
        "as the pipeline's noise_scale (default 0; for a conditioned video the schedule's first sigma, 1 without "
        "--sigmas, as LTX2ConditionPipeline's)",
        start_only=True,
    ),
    Option(
        "image_crf",
        "int",
        "image-to-video and one-frame --condition: the H.264 quality an image is re-encoded at before the VAE, as "
        f"the model was trained (0: not re-encoded; default the pipelines': {IMAGE_CRF}, LTX-2.5 "
        f"{LTX2_5_IMAGE_CRF}; needs the `crf` extra, PyAV)",
        later=False,  # stage 1 encodes the image
        splits_batch=False,
        metavar="CRF",
        with_input=("image", CONDITION.name),
        input_default=image_crf,
    ),
    Option(
        "enhance_prompt",
        "bool",
        "rewrite the prompt with the model's prompt enhancer before encoding it (the pipelines' "
        "enable_prompt_enhancement, in PyTorch on --device, seeded with --seed; the text is logged and recorded)",
        later=False,
        splits_batch=False,
    ),
    Option(
        "system_prompt",
        "str",
        "with --enhance_prompt: the instructions the enhancer gets (default: the pipelines' LTX-2.5 prompts; for "
        "earlier releases the Gemma 3 prompts diffusers keeps in pipelines/ltx2/utils.py), text- or image-to-video "
        "by whether an image is given",
        later=False,
        splits_batch=False,
        metavar="TEXT",
    ),
    Option(
        "condition_index",
        "ints",
        "with --condition: the latent frame each condition starts at, one per --condition (negative: from the "
        "end; latent frame k > 0 is pixel frame 8(k-1)+1 on the published VAE; 0 replaces the first frames, later "
        "ones are keyframes the transformer sees beside the video) (default 0, with one --condition)",
        later=False,  # stage 1 trims each clip to the room after its index
        metavar="INDEX",
        with_input=CONDITION.name,
    ),
    Option(
        "condition_strength",
        "floats",
        "with --condition: how strongly each condition holds, from 0 to 1, one number for all or one per "
        "--condition (default 1.0, the pipeline's)",
        later=False,
        metavar="STRENGTH",
        with_input=CONDITION.name,
        input_default=[1.0],
    ),
)

_built = functools.partial(preset_builder, f"{__package__}.presets")
# Sizes are multiples of 32 (the pipeline's rule): 64 x 96 is 4 x 6 latent tokens per frame, not square, so a
# height and width swapped anywhere shows.
TINY_DEFAULTS = {"height": 64, "width": 96, "num_frames": 9, "fps": 24, "num_inference_steps": 4}
PRESETS = {
    "tiny-ltx2": Preset(NAME, _built("tiny_pipeline", "2.0"), TINY_DEFAULTS),
    "tiny-ltx2.3": Preset(NAME, _built("tiny_pipeline", "2.3"), TINY_DEFAULTS),
    "tiny-ltx2-i2v": Preset(NAME, _built("tiny_pipeline", "2.0", image_to_video=True), TINY_DEFAULTS),
    # LTX-2.5: without --num_frames its duration head picks the length
    "tiny-ltx2.5": Preset(NAME, _built("tiny_pipeline", "2.5"), TINY_DEFAULTS),
    "tiny-ltx2.5-i2v": Preset(NAME, _built("tiny_pipeline", "2.5", image_to_video=True), TINY_DEFAULTS),
}
