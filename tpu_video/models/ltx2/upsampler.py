"""LTX-2's x2 latent upsampler, the step between the two-stage pipeline's passes: stage 2's de-normalised video
latents through `LTX2LatentUpsamplerModel`, then the pipeline's optional AdaIN filter and tone map, as
`LTX2LatentUpsamplePipeline` called with `latents=` and `output_type="latent"` does; the audio latents pass
through unchanged (the refine takes the first pass's, as diffusers' two-stage example passes them)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from tpu_video.cli import UserError, log

SUBFOLDER = "latent_upsampler"  # where the published LTX-2 repositories keep it


def load_upsampler(source, location: str | None, dtype: torch.dtype, meta: bool = False):
    """The upsampler: `location` a folder holding its config.json, or a model folder or hub id holding a
    `latent_upsampler` subfolder (default: the model's own), checked against the model's VAE before use.
    The refine runs at twice the size: only a x2 spatial upsampler is taken. `meta` (--plan): built from its
    config on the meta device, no weights read (a published hub id's config is kept in code: published.py)."""
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    where = location or source.location
    subfolder = None if location and (Path(location) / "config.json").is_file() else SUBFOLDER
    named = f"{where}/{subfolder}" if subfolder else where
    try:  # its config first: a wrong folder is refused before any weights load
        config = {**LTX2LatentUpsamplerModel.load_config(where, subfolder=subfolder)}
    except (OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"--latent_upsampler: no LTX-2 latent upsampler in {named} ({first})") from None
    kind = config.get("_class_name")
    if kind != LTX2LatentUpsamplerModel.__name__:
        raise UserError(f"--latent_upsampler {named} holds a {kind}, not an LTX-2 latent upsampler")
    parameters = inspect.signature(LTX2LatentUpsamplerModel.__init__).parameters.values()
    config = {**{p.name: p.default for p in parameters if p.default is not p.empty}, **config}  # defaults filled
    channels = source.load_config("vae")["latent_channels"]
    if config["in_channels"] != channels:
        raise UserError(
            f"--latent_upsampler {named} takes {config['in_channels']} latent channels; this model's VAE makes "
            f"{channels}: it is another model's upsampler"
        )
    scale = config["rational_spatial_scale"] if config["use_rational_resampler"] else 2.0
    if not config["spatial_upsample"] or config["temporal_upsample"] or scale != 2.0:
        raise UserError(f"--latent_upsampler {named}: not a x2 spatial upsampler (the refine runs at twice the size)")
    if meta:
        with torch.device("meta"):
            model = LTX2LatentUpsamplerModel.from_config(config).eval()  # float32, as the class builds it
        return model if dtype == torch.float32 else model.to(dtype)
    try:
        return LTX2LatentUpsamplerModel.from_pretrained(where, subfolder=subfolder, torch_dtype=dtype).eval()
    except (OSError, ValueError) as err:
        raise UserError(f"--latent_upsampler {named}: its weights cannot be read ({type(err).__name__})") from None


def plan_upsample(source, request, location, runtime, *filters) -> dict:
    """--upsample --plan: `upsample` on a planning runtime (which compiles its program for the TPU) with the upsampler
    built on the meta device and zero video latents of `request`'s first pass; what the section would record."""
    from tpu_video.runtime.interface import Timer

    from .config import latent_grid

    latents = torch.zeros(1, source.load_config("vae")["latent_channels"], *latent_grid(source, request))
    return upsample(source, location, {"latents": latents}, runtime, Timer(), *filters, planning=True)[2]


class Upsample(torch.nn.Module):
    """The upsample pipeline's steps after it has the latents, as one program (its own methods)."""

    def __init__(self, upsampler: torch.nn.Module, adain_factor: float, tone_map_compression_ratio: float) -> None:
        super().__init__()
        self.upsampler = upsampler
        self.adain_factor, self.tone_map = adain_factor, tone_map_compression_ratio

    def forward(self, latents):
        from diffusers import LTX2LatentUpsamplePipeline as Pipeline

        latents = latents.to(next(self.upsampler.parameters()).dtype)
        upsampled = self.upsampler(latents)
        # The pipeline's filters read nothing of the pipeline object: called unbound.
        if self.adain_factor > 0.0:
            upsampled = Pipeline.adain_filter_latent(None, upsampled, latents, self.adain_factor)
        if self.tone_map > 0.0:
            upsampled = Pipeline.tone_map_latents(None, upsampled, self.tone_map)
        return upsampled


def split_layout(shape, runtime) -> tuple:
    """The first pass's latents split along width (else height) over every device where one of them divides
    evenly, as stage 3 splits them, so each device upsamples its part (the convolutions' halos cross devices);
    else whole on every device."""
    from tpu_video.engine.decode import latents_split, split_over_mesh

    mesh = getattr(runtime, "mesh", None)
    if mesh is None or latents_split(shape, mesh.devices.size)[0] not in ("width", "height"):
        return ()
    return split_over_mesh(shape, mesh)


def named_default(source) -> str:
    return f"{source.ref}/{SUBFOLDER}"


def upsample(
    source, location, tensors, runtime, timer, adain_factor=0.0, tone_map_compression_ratio=0.0, planning=False
):
    """Stage 2's tensors upsampled on `runtime` (one program, the weights replicated, the latents split as
    `split_layout` says): (the new tensors, the spatial scale, what the section records). `planning`: the
    upsampler on the meta device (`plan_upsample`)."""
    with timer.phase("load"):
        model = load_upsampler(source, location, torch.float32, meta=planning)
    log(
        f"the x2 latent upsampler from {location or named_default(source)}, in float32 (its filters: AdaIN "
        f"{adain_factor:g}, tone map {tone_map_compression_ratio:g})"
    )
    with timer.phase("place"):
        program = runtime.compile(Upsample(model, adain_factor, tone_map_compression_ratio))
    with timer.phase("upsample"), torch.no_grad(), runtime.precision(torch.float32):  # fp32 matmuls on a TPU too
        latents = tensors["latents"].float()
        video = runtime.to_host(program(runtime.to_device(latents, split_layout(latents.shape, runtime)))).float()
    named = (Path(location).name if Path(location).exists() else location) if location else named_default(source)
    record = {
        "upsampler": named,  # a local folder by its name (no host paths in a config)
        "mid_channels": model.config.mid_channels,
        "adain_factor": adain_factor,
        "tone_map_compression_ratio": tone_map_compression_ratio,
    }
    return {**tensors, "latents": video}, 2, record
