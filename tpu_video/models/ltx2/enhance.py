"""The prompt enhancer (stage 1's `--enhance_prompt`): the pipelines' own `enhance_prompt` rewrites the prompt
before it is encoded, as `LTX2Pipeline` does when called with `enable_prompt_enhancement=True`. LTX-2.5 folders
hold a dedicated enhancer (`prompt_enhancer`, Gemma 4); earlier releases use their text encoder (Gemma 3). Both
need the folder's chat `processor`. It runs in PyTorch on the runtime's torch device (`--device`; the CPU under
torchax), before the text encoders load, and is freed before they do."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpu_video.cli import UserError, log
from utils import Request

from .config import has_component, stock_pipeline

ENHANCER, PROCESSOR = "prompt_enhancer", "processor"


def check_enhancement(source, request: Request) -> None:
    """Stage 1, before any weights load: refuse what the enhancer could not run."""
    if request.option("system_prompt") is not None and not request.option("enhance_prompt"):
        raise UserError("--system_prompt: it instructs the prompt enhancer; give --enhance_prompt too")
    # Published configs kept for --plan list no processor; the enhancer is not planned (it runs in PyTorch).
    if request.option("enhance_prompt") and not source.configs_only and not has_component(source, PROCESSOR):
        raise UserError(
            f"--enhance_prompt: {source.ref!r} has no `{PROCESSOR}` folder (the enhancer's chat template and image "
            "processing); the published LTX-2 folders keep one"
        )


def default_system_prompt(source, with_image: bool) -> str:
    """The instructions a run without --system_prompt gives the enhancer: LTX-2.5's pipelines' defaults for its
    dedicated enhancer; for the earlier releases (whose pipelines demand one) the Gemma 3 prompts diffusers keeps
    beside them, text- or image-to-video."""
    from diffusers.pipelines.ltx2 import utils

    if has_component(source, ENHANCER):
        return utils.LTX2_5_I2V_DEFAULT_SYSTEM_PROMPT if with_image else utils.LTX2_5_T2V_DEFAULT_SYSTEM_PROMPT
    return utils.I2V_DEFAULT_SYSTEM_PROMPT if with_image else utils.T2V_DEFAULT_SYSTEM_PROMPT


def first_image(inputs: dict):
    """The image the pipelines show the enhancer: image-to-video's first frame, else the first condition's first
    frame (LTX2ConditionPipeline), else none."""
    if "image" in inputs:
        return inputs["image"]
    conditions = inputs.get("condition") or []
    return conditions[0][0] if conditions else None


def prompt_enhancer(source, dtype: torch.dtype, runtime) -> Callable[[Request, dict], str | None]:
    """A function of a request and its media inputs giving the rewritten prompt (None where the request does not
    ask); the enhancer loads on first use and goes with the function."""
    loaded = []

    def enhance(request: Request, inputs: dict) -> str | None:
        if not request.option("enhance_prompt"):
            return None
        if not loaded:
            loaded.append(enhancing_pipeline(source, dtype))
        image = first_image(inputs)
        system_prompt = request.option("system_prompt")
        if system_prompt is None:  # the pipelines' rule: only a missing one takes the default
            system_prompt = default_system_prompt(source, image is not None)
        # The pipelines seed the enhancer with their generator's seed: the request's.
        [text] = loaded[0].enhance_prompt(
            prompt=request.prompt, system_prompt=system_prompt, seed=request.seed, device=runtime.device, image=image
        )
        log(f"the prompt enhancer wrote: {text!r}")
        return text

    return enhance


def enhancing_pipeline(source, dtype: torch.dtype):
    """The source's pipeline holding only the enhancer and its processor."""
    try:
        processor = source.load(PROCESSOR)
    except ImportError as err:  # Gemma 4's processor builds a video processor, which needs torchvision
        raise UserError(f"--enhance_prompt: cannot load the `{PROCESSOR}` of {source.ref!r}: {err}") from None
    name = ENHANCER if has_component(source, ENHANCER) else "text_encoder"
    log(f"loading the prompt enhancer ({name})")
    return stock_pipeline(source, processor=processor, **{name: source.load(name, dtype=dtype).eval()})
