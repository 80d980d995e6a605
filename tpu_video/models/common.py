"""Small helpers several families share: the noise dtype, one-transformer and scaling-factor defaults of
the family interface, flow-matching schedulers by name, head counts, activation estimates, and block input
layouts.

The shared engine's larger parts have their own modules: stage 1's encoders (encoders.py), stage 2's loop
(denoise.py), stage 3's decode (decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpu_video.cli import UserError
from tpu_video.engine.inputs import image_input
from tpu_video.runtime.mesh import Activations

if TYPE_CHECKING:  # annotations only
    import torch


def one_transformer(source) -> tuple[str, ...]:
    """`transformer_components` of a family with a single transformer."""
    return ("transformer",)


def vae_scaling_factor(source) -> dict[str, Any]:
    """`latents_normalization` of a family whose latents are the VAE's times its `scaling_factor`."""
    return {"method": "scaling_factor", "scaling_factor": source.load_config("vae")["scaling_factor"]}


def stage2_as_written(source, tensors: dict, normalization: dict[str, Any]) -> tuple[dict, dict[str, Any]]:
    """`upgrade_stage2` of a family whose every stage 2 wrote what stage 3 decodes: unchanged."""
    return tensors, normalization


def recorded_scaling_factor(normalization: dict[str, Any]) -> float:
    """The scaling factor stage 2 recorded; any other normalisation is a wrong folder for this family."""
    if normalization.get("method") != "scaling_factor":
        raise UserError(f"these latents are normalised as {normalization}; this family's VAE expects a scaling factor")
    return normalization["scaling_factor"]


# Flow-matching samplers by --scheduler name: the class, its name for the flow shift, and what makes it a
# flow sampler when built from another scheduler's config.
FLOW_SCHEDULERS = {
    "unipc": ("UniPCMultistepScheduler", "flow_shift", {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}),
    "euler": ("FlowMatchEulerDiscreteScheduler", "shift", {}),
}


def _shift_key(class_name: str, source) -> str:
    key = {cls: key for cls, key, _ in FLOW_SCHEDULERS.values()}.get(class_name)
    if key is None:
        raise UserError(f"the scheduler of {source.ref!r} ({class_name}) has no flow shift")
    return key


def folder_flow_shift(source) -> float:
    """The flow shift the model folder's scheduler config records (the default --flow_shift)."""
    config = source.load_config("scheduler")
    return config[_shift_key(config["_class_name"], source)]


def flow_scheduler(source, shift: float, name: str | None = None):
    """The model folder's scheduler (or the `name`d FLOW_SCHEDULERS sampler built from its config) with the
    flow shift `shift`. Built with from_config: FlowMatchEuler keeps its shift from construction, so a
    register_to_config afterwards would leave the old shift in place."""
    import diffusers

    config = source.load_config("scheduler")
    class_name = config["_class_name"] if name is None else FLOW_SCHEDULERS[name][0]
    extra = {} if name is None or class_name == config["_class_name"] else FLOW_SCHEDULERS[name][2]
    return getattr(diffusers, class_name).from_config(config, **extra, **{_shift_key(class_name, source): shift})


# The image inputs of the image-to-video pipelines (a family's MEDIA_INPUTS), in the order they take them.
IMAGE = image_input(
    "image",
    "image-to-video: the first frame (any still image Pillow reads), required by i2v models",
    missing="is an image-to-video model: give the first frame with --image PATH",
)
LAST_IMAGE = image_input("last_image", "image-to-video: the last frame, where the model takes one (Wan 2.2 A14B)")


def size_from_request(source, images) -> None:
    """`size_from_inputs` of a family whose pipelines resize the image to the requested size (None: keep it)."""
    return None


def no_image_checks(source, request, images) -> None:
    """`check_inputs` of a family whose image conditioning needs nothing beyond its weights."""


def activations(source, tokens: int, dtype: torch.dtype, copies: tuple[float, float], fp32: float = 0.0):
    """One sample's runtime.mesh.Activations: `tokens` video tokens at the transformer's width in `dtype`,
    with the family's fitted (whole, split) copies and float32 copies."""
    config = source.load_config("transformer")
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return Activations(tokens, width, dtype.itemsize, *copies, fp32)


def constrain_block_inputs(blocks, constrain, specs: dict[str | int, tuple], barrier=None) -> None:
    """Pin the layout of each block's inputs (`specs` by keyword name or by position), so XLA's sharding
    propagation does not pick a different one per block (e.g. the width split over `tp` that a
    row-parallel weight suggests, which then costs an all-gather before the next linear). With `barrier`
    (Runtime.barrier) the positional inputs also pass one optimization barrier together: work in a block
    that reads only inputs shared by all blocks (a timestep's modulation) then waits for the block before,
    instead of being scheduled for every block at once with all the results alive together."""

    def hook(module, args, kwargs):
        args = tuple(constrain(value, specs[index]) if index in specs else value for index, value in enumerate(args))
        if barrier is not None:
            args = barrier(*args)
        return args, {name: constrain(value, specs[name]) if name in specs else value for name, value in kwargs.items()}

    for block in blocks:
        block.register_forward_pre_hook(hook, with_kwargs=True)


def num_layers_only(source, component: str, num_layers: int) -> dict[str, Any]:
    """`depth_overrides` of a family whose transformer config names its depth in `num_layers` alone."""
    return {"num_layers": num_layers}


def every_step(source, request, task: str) -> int:
    """Family.denoise_steps of a family whose loop runs the whole schedule."""
    return request.num_inference_steps


def fixed_length(source) -> None:
    """`frames_from_prompt` of a family whose video is always as long as the request says."""
    return None


def no_prompt_enhancer(source, dtype, runtime) -> None:
    """`prompt_enhancer` of a family whose pipelines encode the prompt as given."""
    return None


def no_upsample(family: str):
    """`upsample` and `plan_upsample` of a family without a latent upsampler between passes."""
    why = f"--upsample: {family} has no latent upsampler (LTX-2's two-stage pipeline has one)"

    def upsample(source, location, tensors, runtime, timer, *filters):
        raise UserError(why)

    def plan_upsample(source, request, location, runtime, *filters):
        raise UserError(why)

    return upsample, plan_upsample
