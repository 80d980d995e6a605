"""A toy model family, registered as another package would register one: its `toy_video-0.1.dist-info`
declares this module in the entry-point group `tpu_video.families`, and a folder holding both on
PYTHONPATH (or a pip install of such a package) makes the stages find it. No module of tpu_video names it.

It is Wan 2.1's tiny text-to-video model with three things of its own:

- a request option, `--latent_gain` (stage 2's final latents times it; default 1; later stages may
  override it, and videos with different gains are never batched together);
- a media input of a kind no built-in family reads, `--caption_file`: a UTF-8 text file whose text stage 1
  appends to the prompt before encoding it (recorded with its sha256 like any input);
- its preset, `tiny-toy` (Wan 2.1's tiny components, built in code).

Everything else is Wan's, taken member by member from the interface (`tpu_video.models.family`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError, parse_dtype
from tpu_video.cli.options import Option
from tpu_video.engine.inputs import MediaInput
from tpu_video.models import wan
from tpu_video.models.family import Preset, family_members

globals().update({name: getattr(wan, name) for name in family_members()})  # Wan's, unless replaced below

NAME = "toy"
PIPELINE_CLASSES = ()  # no diffusers pipeline class of its own: its preset is its only model
PUBLISHED: dict[str, dict[str, Any]] = {}
PRESETS = {"tiny-toy": Preset(NAME, wan.PRESETS["tiny-wan2.1"].build, wan.PRESETS["tiny-wan2.1"].defaults)}
OPTIONS = (Option("latent_gain", "float", "toy: stage 2's final latents are multiplied by it (default 1)"),)


def read_caption(path: str, flag: str) -> tuple[str, dict[str, Any]]:
    """The caption file's text (surrounding blank space removed), and its length for the record."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--{flag} {path}: cannot read it as UTF-8 text ({err})") from None
    if not text:
        raise UserError(f"--{flag} {path} holds no text")
    return text, {"characters": len(text)}


CAPTION = MediaInput(
    "caption_file", "toy: a text file whose text is appended to the prompt", read_caption, kind="text", task="t2v"
)
MEDIA_INPUTS = (CAPTION,)


def media_inputs(source) -> tuple[MediaInput, ...]:
    return MEDIA_INPUTS


def validate_request(source, request) -> None:
    wan.validate_request(source, request)
    gain = request.option("latent_gain")
    if gain is not None and gain <= 0:
        raise UserError(f"--latent_gain {gain} must be positive")


def check_inputs(source, request, inputs: dict[str, Any]) -> None:
    """Nothing beyond what the reader checked."""


def encode_inputs(source, request, inputs: dict[str, Any], runtime) -> dict:
    """The prompt encoded again with the caption appended: its embeddings replace the prompt-only ones."""
    captioned = dataclasses.replace(request, prompt=f"{request.prompt} {inputs['caption_file']}")
    return wan.prompt_encoder(source, parse_dtype(request.dtype), runtime)(captioned)


def denoise_loop(source, request, embeds, dtype, transformers, runtime, tp_mode, *, planning: bool):
    """Wan's loop; its final latents times the request's gain."""
    loop, finish = wan.denoise_loop(source, request, embeds, dtype, transformers, runtime, tp_mode, planning=planning)
    gain = request.option("latent_gain")

    def gained(latents):
        tensors, facts = finish(latents)
        return ({**tensors, "latents": tensors["latents"] * gain} if gain is not None else tensors), facts

    return loop, gained
