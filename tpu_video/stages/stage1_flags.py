"""Stage 1's flags (stage1_text_encoder.py --help): the model, the prompt or a list of them, the media inputs,
the output folder, dtype, backend and device, LoRA, planning, and the request."""

from __future__ import annotations

from tpu_video import models
from tpu_video.cli import add_executables_argument, add_plan_arguments, dtype_flag, flag_names, stage_parser
from tpu_video.stages.request import add_media_arguments, add_request_arguments
from utils import DEFAULT_OUTPUT_DIR

DEFAULT_MODEL = "zai-org/CogVideoX1.5-5B"


def build_parser(script: str, description: str | None):
    """The stage's argparse parser (`script` and `description`: the stage script's file and docstring)."""
    parser = stage_parser(script, description)
    parser.add_argument(
        *flag_names("--model"),
        dest="model",
        default=DEFAULT_MODEL,
        help=f"hub id, local diffusers folder, or preset ({', '.join(models.PRESETS)}); default: %(default)s (a hub "
        "id downloads the whole model into the Hugging Face cache on first use: tens of GB for the published ones; "
        "make demo runs a tiny preset)",
    )
    parser.add_argument("--prompt", help="what the video should show (or --prompts FILE)")
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help="many videos: one prompt per line, or JSON Lines with prompt and optionally negative_prompt, seed, "
        "name and the media inputs (image, last_image, ...) (blank lines and # comments skipped); one stage folder "
        "per entry under --output_dir, listed in batch.json",
    )
    parser.add_argument("--seeds", metavar="LIST", help="a seed sweep of --prompt: one folder per seed, e.g. 1,2,5-8")
    parser.add_argument("--negative_prompt", default="", help="what to steer away from (default: empty)")
    add_media_arguments(parser)
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR, help="stage folder (default: %(default)s)")
    parser.add_argument(
        "--dtype", type=dtype_flag, default="bf16", help="bf16, fp16 or fp32 (or float32, ...) (default: %(default)s)"
    )
    parser.add_argument("--backend", choices=("torch", "torchax"), default="torch", help="default: %(default)s")
    parser.add_argument("--device", help="torch device for --backend torch (default: cpu)")
    parser.add_argument(
        "--no_compile_cache", action="store_true", help="torchax: do not use the persistent JAX compilation cache"
    )
    add_executables_argument(parser)
    lora = parser.add_argument_group("LoRA adapters (LTX-2's text connectors; docs/lora.md)")
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="LTX-2: a LoRA adapter whose weights also change the text connectors (stage 1 fuses those; give stage 2 "
        "the same --lora for the transformer's): as stage 2's --lora; repeatable",
    )
    add_plan_arguments(parser, "the text encoders (and image encoders) as --backend torchax runs them for this request")
    add_request_arguments(parser, for_later_stage=False)
    return parser
