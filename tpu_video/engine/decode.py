"""Stage 3's decode for every family: the latents' spatial split over the devices, the VAE decode as one
program or through the family's frame programs (a host loop over frame chunks), and the pipeline's own
post-processing to frames in [0, 1]; for families with sound, the soundtrack.
"""

from __future__ import annotations

from typing import Any

import torch

from sharding import AXES, DP, SP
from tpu_video.runtime.interface import Runtime, Timer, TorchRuntime

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


def split_over_mesh(shape, mesh) -> tuple:
    """`latents_split`'s layout over every device of a dp/sp/tp mesh (stage 2's, decoding and encoding Wan
    Animate's segments): the split dimension over all three axes."""
    if mesh is None:
        return ()
    _, layout = latents_split(shape, mesh.devices.size)
    return tuple(AXES if axis == SP else axis for axis in layout)


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


def run_in_chunks(programs, names: list[str], spans: list[tuple[int, int]], latents, runtime, layout):
    """The host loop over frame chunks (the families' frame programs; Wan's encoder programs): chunk i, frames
    `spans[i]` of `latents`, through the program `names[i]` with the state the previous call returned; the
    outputs joined along frames on the host (stage 3: the video (B, 3, frames, H, W))."""
    pieces, state = [], ()
    for name, (start, end) in zip(names, spans, strict=True):
        inputs = runtime.to_device(latents[:, :, start:end].contiguous(), layout)
        out, *state = getattr(programs, name)(inputs, *state)
        pieces.append(runtime.to_host(out))
    return torch.cat(pieces, dim=2)


def soundtrack_runtime(runtime, backend: str):
    """Where the soundtrack (audio VAE and vocoder) runs: with `--backend torch` on its device (a GPU with
    --device cuda); with `--backend torchax` on the host in PyTorch, because the TPU compiler took 20 minutes to
    build LTX-2.0's soundtrack program (docs/ltx2.md#the-soundtrack)."""
    return runtime if backend == "torch" else TorchRuntime("cpu")


def decode_soundtrack(family, source, latents, dtype, runtime, timer, programs: dict) -> tuple[torch.Tensor, int]:
    """The family's soundtrack (audio VAE and vocoder as one module on `runtime`; built on first use and kept
    in `programs` for every folder of the same model and dtype): the waveform (channels, samples) float32 in
    [-1, 1] and its sample rate."""
    key = ("soundtrack", source.location, dtype)
    if key not in programs:
        with timer.phase("load"):
            parts = [source.load(name, dtype=dtype).eval() for name in family.Soundtrack.COMPONENTS]
        with timer.phase("place"):
            soundtrack = family.Soundtrack(*parts)
            programs[key] = runtime.compile(soundtrack), soundtrack.sample_rate
    program, rate = programs[key]
    with timer.phase("audio"), torch.no_grad():
        waveform = runtime.to_host(program(runtime.to_device(latents.to(dtype))))
    return waveform[0].float(), rate
