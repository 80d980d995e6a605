"""Media files a stage writes: the H.264 mp4 (with an AAC soundtrack where the family makes sound), the WAV
it muxes from, and the preview grid PNG; each written atomically."""

from __future__ import annotations

from pathlib import Path

import torch

from utils import atomic_write


def write_mp4(path: Path, frames, fps: int, audio: tuple[torch.Tensor, int] | None = None) -> None:
    """Encode uint8 frames (F, H, W, 3) as H.264 mp4 with imageio-ffmpeg, atomically; with `audio` (a waveform
    (channels, samples) in [-1, 1] and its sample rate), an AAC track muxed in by the same ffmpeg call, which
    reads it from a 16-bit WAV written beside the temporary mp4."""
    import imageio_ffmpeg

    _, height, width, _ = frames.shape

    def write(tmp: Path) -> None:
        wav = tmp.with_suffix(".wav")
        if audio is not None:
            write_wav(wav, *audio)
        try:
            writer = imageio_ffmpeg.write_frames(
                str(tmp),
                (width, height),
                fps=fps,
                codec="libx264",
                pix_fmt_out="yuv420p",
                macro_block_size=1,
                quality=8,
                ffmpeg_log_level="error",
                **({"audio_path": str(wav), "audio_codec": "aac"} if audio is not None else {}),
            )
            writer.send(None)
            for frame in frames:
                writer.send(frame.tobytes())
            writer.close()
        finally:
            wav.unlink(missing_ok=True)

    atomic_write(path, write)


def write_wav(path: Path, waveform: torch.Tensor, sample_rate: int) -> None:
    """A waveform (channels, samples) in [-1, 1] as 16-bit PCM WAV (the standard library's writer)."""
    import wave

    pcm = (waveform.clamp(-1, 1).numpy().T * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(pcm.shape[1])
        file.setsampwidth(2)
        file.setframerate(sample_rate)
        file.writeframes(pcm.tobytes())


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
