"""What every family shares in stages 1 and 3: the runtime `--backend` names, text encoders on it, and
the VAE decode to an mp4.

Stage 2's shared loop is in models/denoise.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.interface import Runtime, Timer, TorchRuntime
from sharding import DP, SP, TP
from utils import UserError, atomic_write
from workarounds.torchax import quiet_attribute_scan

# Stage 3: (B, C, F, H, W) latents split along width over the mesh's `sp` axis, or along height; or
# (measured, not a default: docs/planning.md) height over a `dp` x `sp` mesh's dp and width over its sp.
LATENTS_WIDTH_SPLIT = (None, None, None, None, SP)
LATENTS_HEIGHT_SPLIT = (None, None, None, SP, None)
LATENTS_GRID_SPLIT = (None, None, None, DP, SP)


UNEVEN_WIDTH = "width, uneven"


def latents_split(shape, devices: int) -> tuple[str | None, tuple]:
    """Stage 3's spatial split of the latents over `devices`: along width where the count divides the latent
    width, else along height where it divides that (CogVideoX1.5's 1360 pixels make 170 latent columns), else
    along width unevenly (HunyuanVideo-1.5 480p's 53 columns: the frame programs place the latents whole and
    constrain them inside, where XLA pads the last shards); (the axis, the layout). Narrower than the
    devices: kept whole (None)."""
    if shape[-1] % devices == 0:
        return "width", LATENTS_WIDTH_SPLIT
    if shape[-2] % devices == 0:
        return "height", LATENTS_HEIGHT_SPLIT
    return (UNEVEN_WIDTH if shape[-1] >= devices else None), LATENTS_WIDTH_SPLIT


# Stage 2's initial noise is drawn in fp32 on the CPU and then cast to the run's dtype, so a seed gives
# the same latents on every host: torch 2.11's CPU randn draws another sequence in bf16 than in fp32
# (torch 2.13 draws the fp32 values, rounded), while its fp32 draws equal torch 2.13's (checked on the
# GPU host, whose torch is 2.11). The pipelines draw in the run's dtype; on torch 2.13 that is the same.
NOISE_DTYPE = torch.float32

BACKENDS = ("torch", "torchax")
STAGE3_BACKENDS = ("auto", *BACKENDS)


def check_backend_flags(backend: str, device: str | None) -> None:
    """Refuse `--backend`/`--device` combinations up front, before any file is read."""
    if backend not in STAGE3_BACKENDS:
        raise UserError(f"--backend {backend!r} is not one of {', '.join(STAGE3_BACKENDS)}")
    if backend == "torchax" and device is not None:  # it would be silently ignored: every JAX device is used
        raise UserError(f"--device applies to --backend torch; --backend {backend} uses every JAX device")
    if device is not None:
        check_torch_device(device)


def check_torch_device(name: str) -> None:
    """`--device` must name a torch device this host has (cpu, cuda, cuda:N, mps)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:N or mps)") from None
    probes = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if device.type not in probes:
        raise UserError(f"--device {name!r}: stages run on cpu, cuda or mps")
    if not probes[device.type]():
        found = "has no MPS device"
        if device.type == "cuda":
            count = torch.cuda.device_count()
            found = "is built without CUDA" if torch.version.cuda is None else f"sees {count} CUDA GPU(s)"
        raise UserError(f"--device {name}: this torch {found}; use --device cpu (or --backend torchax)")


def jax_platform() -> str | None:
    """The platform of JAX's default devices ("tpu", "gpu", "cpu"), or None when JAX cannot be imported.
    Imports JAX: called only once torch has no GPU."""
    from workarounds.libtpu import libtpu_off_tpu

    libtpu_off_tpu()  # as workarounds.torchax does: off a TPU VM, libtpu must not try to claim one
    try:
        import jax
    except ImportError:
        return None
    return jax.devices()[0].platform


def choose_backend(backend: str, device: str | None, cuda=None, platform=jax_platform) -> tuple[str, str | None, str]:
    """Stage 3's `--backend auto`: torch on CUDA when torch sees a GPU (JAX never imported), else torchax
    when JAX sees a TPU or GPU, else torch on the CPU. Returns (backend, device, the reason in words);
    an explicit backend is kept. `cuda` and `platform` are the probes (replaced in tests)."""
    if backend != "auto":
        return backend, device, "as given"
    if device is not None:
        return "torch", device, f"--device {device} given: torch"
    if (cuda or torch.cuda.is_available)():
        return "torch", "cuda", "torch sees a CUDA GPU: torch on cuda"
    found = platform()
    if found in ("tpu", "gpu"):
        return "torchax", None, f"torch sees no GPU, JAX sees a {found.upper()}: torchax on every JAX device"
    jax_says = "JAX is not installed" if found is None else f"JAX sees only {found}"
    return "torch", "cpu", f"torch sees no GPU and {jax_says}: torch on cpu"


def open_runtime(backend: str, device: str | None, axis: str, compile_cache: bool = True) -> Runtime:
    """Stages 1 and 3: `--backend torch` on `--device` (default cpu), or `--backend torchax` with every JAX
    device on mesh axis `axis`. A host without JAX gets one error line naming the install."""
    check_backend_flags(backend, device)
    if backend == "torch":
        return TorchRuntime(device or "cpu")
    try:
        from runtime import torchax_runtime
    except ImportError as err:
        raise UserError(
            f"--backend torchax needs JAX and torchax ({err}); install them with "
            "pip install -e '.[tpu]' (or .[gpu], .[cpu]), or use --backend torch"
        ) from None
    return torchax_runtime.TorchaxRuntime.on_all_devices(axis, compile_cache=compile_cache)


def one_transformer(source) -> tuple[str, ...]:
    """`transformer_components` of a family with a single transformer."""
    return ("transformer",)


def vae_scaling_factor(source) -> dict[str, Any]:
    """`latents_normalization` of a family whose latents are the VAE's times its `scaling_factor`."""
    return {"method": "scaling_factor", "scaling_factor": source.load_config("vae")["scaling_factor"]}


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


def size_from_request(source, images) -> None:
    """`image_size` of a family whose pipelines resize the image to the requested size (None: keep it)."""
    return None


def attention_heads(source) -> int:
    """The transformer's attention head count (what `tp` must divide), from its config alone."""
    return source.load_config("transformer")["num_attention_heads"]


def constrain_block_inputs(blocks, constrain, specs: dict[str | int, tuple]) -> None:
    """Pin the layout of each block's inputs (`specs` by keyword name or by position), so XLA's sharding
    propagation does not pick a different one per block (e.g. the width split over `tp` that a
    row-parallel weight suggests, which then costs an all-gather before the next linear)."""

    def hook(module, args, kwargs):
        args = tuple(constrain(value, specs[index]) if index in specs else value for index, value in enumerate(args))
        return args, {name: constrain(value, specs[name]) if name in specs else value for name, value in kwargs.items()}

    for block in blocks:
        block.register_forward_pre_hook(hook, with_kwargs=True)


# Stage 1 -------------------------------------------------------------------------------------------


def text_encoder_rules(config) -> Any:
    """A function of the mesh's axis sizes giving the encoder's rule table (called only where a mesh
    exists, so plain-torch stage 1 never imports JAX)."""

    def rules(mesh_shape: dict[str, int]):
        import sharding

        try:
            table = sharding.text_encoder_rules(config, mesh_shape[TP])
        except ValueError as err:
            raise UserError(f"{err}; run stage 1 with --backend torch") from None
        return table.nested("encoder.")

    return rules


class _EncoderOutputs(torch.nn.Module):
    """The jitted side: plain tensors out (jax.jit returns no ModelOutput or cache objects)."""

    def __init__(self, encoder: torch.nn.Module, hidden_states: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.hidden_states = hidden_states

    def forward(self, input_ids, attention_mask):
        if not self.hidden_states:
            return (self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)
        output = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return (output.last_hidden_state, *output.hidden_states)


class _OnRuntime(torch.nn.Module):
    """A stand-in for a pipeline component whose work runs compiled on a runtime: it has the component's
    `config` and `dtype`, and says its `device` is the host, where the pipelines put its inputs (they ask
    the module, diffusers' get_module_execution_device, which would otherwise find the weights' 'jax' device)."""

    def __init__(self, module: torch.nn.Module, runtime: Runtime, jitted_side: torch.nn.Module, rules=None) -> None:
        super().__init__()
        self.config = module.config
        self.module_dtype = module.dtype
        self.runtime = runtime
        with quiet_attribute_scan():
            self.jitted = runtime.compile(jitted_side, rules)

    @property
    def dtype(self) -> torch.dtype:
        return self.module_dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class DeviceTextEncoder(_OnRuntime):
    """A text encoder on a runtime, called as diffusers pipelines call one on the host: CPU token ids in,
    a CPU `BaseModelOutput` out (`[0]` and, if built with `hidden_states`, every layer's
    `.hidden_states`). On a JAX mesh its weights are split over `tp` by the encoder's rule table and
    it compiles once per input shape (the pipelines pad to a fixed length)."""

    def __init__(self, encoder: torch.nn.Module, runtime: Runtime, hidden_states: bool = False) -> None:
        jitted_side = _EncoderOutputs(encoder, hidden_states)
        super().__init__(encoder, runtime, jitted_side, text_encoder_rules(encoder.config))

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None):
        from transformers.modeling_outputs import BaseModelOutput

        outputs = self.jitted(*self.runtime.to_device((input_ids, attention_mask)))
        last, *layers = (self.runtime.to_host(output) for output in outputs)
        if output_hidden_states and not layers:
            raise ValueError("this DeviceTextEncoder was built without hidden_states")
        return BaseModelOutput(last_hidden_state=last, hidden_states=tuple(layers) or None)


class _ImageEncoderOutputs(torch.nn.Module):
    """The jitted side of an image encoder: the last hidden state and every layer's, as plain tensors."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values):
        output = self.encoder(pixel_values=pixel_values, output_hidden_states=True)
        return (output.last_hidden_state, *output.hidden_states)


class DeviceImageEncoder(_OnRuntime):
    """An image encoder (CLIP, SigLIP) on a runtime, called as the pipelines call one on the host: CPU pixel
    values in, a CPU `BaseModelOutput` out (`last_hidden_state` and every layer's `hidden_states`). Its
    weights are replicated (a few hundred million parameters); it compiles once per image size."""

    def __init__(self, encoder: torch.nn.Module, runtime: Runtime) -> None:
        super().__init__(encoder, runtime, _ImageEncoderOutputs(encoder))

    def forward(self, pixel_values, output_hidden_states=None, **_):
        from transformers.modeling_outputs import BaseModelOutput

        outputs = self.jitted(*self.runtime.to_device((pixel_values,)))
        last, *layers = (self.runtime.to_host(output) for output in outputs)
        return BaseModelOutput(last_hidden_state=last, hidden_states=tuple(layers))


class _Moments(torch.nn.Module):
    """The jitted side of a VAE encode: the posterior's parameters (mean and log-variance)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, pixels):
        return (self.vae.encode(pixels).latent_dist.parameters,)


class DeviceVAEEncoder(_OnRuntime):
    """A VAE whose `encode` runs on a runtime, for the pipelines' single-image encodes: CPU pixels in, the
    posterior out on the host, as `vae.encode(x)` returns it (`.latent_dist`). Weights replicated."""

    def __init__(self, vae: torch.nn.Module, runtime: Runtime) -> None:
        super().__init__(vae, runtime, _Moments(vae))

    def encode(self, pixels, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        (parameters,) = self.jitted(*self.runtime.to_device((pixels,)))
        return AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(self.runtime.to_host(parameters)))


# Stage 3 -------------------------------------------------------------------------------------------


def decode(
    family,
    source,
    latents: torch.Tensor,
    normalization: dict[str, Any],
    dtype: torch.dtype,
    runtime: Runtime,
    timer: Timer,
    tiling=False,
    chunk_frames: int | None = None,
    vae=None,
):
    """Load the VAE, decode on `runtime` with the family's `Decoder` (undoing `normalization`, what stage
    2 recorded; latents to pixels in [-1, 1]): as one graph, or with `chunk_frames` through the family's
    frame programs (`frame_programs`: a host loop, the decoder's state carried between calls); then
    post-process with the pipeline's own processor: frames (F, H, W, 3) float32 in [0, 1]. `vae`: one
    loaded before (stage 3 decoding several folders), else loaded here."""
    processor = family.video_processor(source)
    if vae is None:
        with timer.phase("load"):
            vae = source.load("vae", dtype=dtype).eval()
    if tiling:
        vae.enable_tiling()
    latents = latents.to(dtype)
    mesh = getattr(runtime, "mesh", None)
    _, layout = latents_split(latents.shape, mesh.devices.size if mesh is not None else 1)
    with timer.phase("place"):  # weights replicated
        if chunk_frames:
            decoder = family.frame_programs(
                source, family.Decoder(vae, normalization), latents.shape, runtime, layout, chunk_frames
            )
        else:
            decoder = runtime.compile(family.Decoder(vae, normalization))
            device_latents = runtime.to_device(latents, layout)
    with timer.phase("decode"), torch.no_grad():
        if chunk_frames:
            video = decoder(latents)
        else:
            video = runtime.to_host(decoder(device_latents))
    frames = processor.postprocess_video(video=video.float(), output_type="np")
    return torch.from_numpy(frames[0])


def frame_batches(frames: int, size: int) -> list[tuple[int, int]]:
    """Latent frames per call, (start, end) each: batches of `size`, the remainder joining the first
    (CogVideoX's stock frame batches; HunyuanVideo-1.5's chunks)."""
    rest = frames % size
    return [(0 if i == 0 else size * i + rest, size * (i + 1) + rest) for i in range(max(frames // size, 1))]


def decode_in_chunks(programs, names: list[str], spans: list[tuple[int, int]], latents, runtime, layout):
    """Stage 3's host loop over frame chunks (the families' frame programs): chunk i, latent frames
    `spans[i]`, through the program `names[i]` with the state the previous call returned; the video
    (B, 3, frames, H, W) on the host."""
    pieces, state = [], ()
    for name, (start, end) in zip(names, spans, strict=True):
        inputs = runtime.to_device(latents[:, :, start:end].contiguous(), layout)
        out, *state = getattr(programs, name)(inputs, *state)
        pieces.append(runtime.to_host(out))
    return torch.cat(pieces, dim=2)


def write_mp4(path: Path, frames, fps: int) -> None:
    """Encode uint8 frames (F, H, W, 3) as H.264 mp4 with imageio-ffmpeg, atomically."""
    import imageio_ffmpeg

    _, height, width, _ = frames.shape

    def write(tmp: Path) -> None:
        writer = imageio_ffmpeg.write_frames(
            str(tmp),
            (width, height),
            fps=fps,
            codec="libx264",
            pix_fmt_out="yuv420p",
            macro_block_size=1,
            quality=8,
            ffmpeg_log_level="error",
        )
        writer.send(None)
        for frame in frames:
            writer.send(frame.tobytes())
        writer.close()

    atomic_write(path, write)


def write_preview_png(path: Path, frames, count: int = 8, columns: int = 4) -> tuple[int, int]:
    """Save `count` evenly spaced frames of uint8 video (F, H, W, 3) as one grid image, atomically.

    Returns the grid's (rows, columns)."""
    import numpy as np
    from PIL import Image

    total, height, width, _ = frames.shape
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(int))
    columns = min(columns, len(picks))
    rows = -(-len(picks) // columns)
    grid = np.zeros((rows * height, columns * width, 3), dtype=np.uint8)
    for cell, index in enumerate(picks):
        row, column = divmod(cell, columns)
        grid[row * height : (row + 1) * height, column * width : (column + 1) * width] = frames[index]
    atomic_write(path, lambda tmp: Image.fromarray(grid).save(tmp, format="PNG"))
    return rows, columns
