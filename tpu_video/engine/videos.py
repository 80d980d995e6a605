"""The video reader of stage 1's video inputs (inputs.py): a video file (mp4, webm, gif, ... as the installed
imageio-ffmpeg decodes it, RGB) or a folder of frame images (in name order, one size), as the list of PIL
images diffusers' video pipelines take, with what the record notes (frame count, size, frame rate), checked
before any weights load."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from utils import sha256_file

from .images import read_image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def read_video(path: str, flag: str) -> tuple[list, dict[str, Any]]:
    """The frames at `path` and the notes the record keeps ({frames, size [height, width], fps}); or one
    UserError naming the file: missing, empty, not a video, a folder without frames or with frames of
    different sizes."""
    file = Path(path)
    if file.is_dir():
        return _read_frame_folder(file, flag)
    if not file.is_file():
        raise UserError(f"--{flag} {path}: no such file or folder")
    if file.stat().st_size == 0:
        raise UserError(f"--{flag} {path} is empty (0 bytes)")
    return _read_video_file(file, flag)


def read_image_or_video(path: str, flag: str) -> tuple[list, dict[str, Any]]:
    """`read_video`'s frames, or one image file as a single frame (with the same notes: frames, size)."""
    if Path(path).is_file() and Path(path).suffix.lower() in FRAME_SUFFIXES:
        image, notes = read_image(path, flag)
        return [image], {"frames": 1, "size": [image.size[1], image.size[0]], **notes}
    return read_video(path, flag)


def video_digest(folder: Path) -> str:
    """A folder of frames' sha256: over each frame file's name and bytes, in the order they are read."""
    digest = hashlib.sha256()
    for path in _frame_files(folder):
        digest.update(f"{path.name}:{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def _frame_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir() if path.suffix.lower() in FRAME_SUFFIXES)


def _read_video_file(file: Path, flag: str) -> tuple[list, dict[str, Any]]:
    import imageio_ffmpeg
    from PIL import Image

    try:
        reader = imageio_ffmpeg.read_frames(str(file), pix_fmt="rgb24")
        meta = next(reader)
        width, height = meta["size"]
        frames = [Image.frombytes("RGB", (width, height), bytes(chunk)) for chunk in reader]
    except (OSError, RuntimeError, StopIteration, KeyError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--{flag} {file} is not a readable video ({first})") from None
    if not frames:
        raise UserError(f"--{flag} {file}: the video has no frames")
    return frames, {"frames": len(frames), "size": [height, width], "fps": meta.get("fps")}


def _read_frame_folder(folder: Path, flag: str) -> tuple[list, dict[str, Any]]:
    files = _frame_files(folder)
    if not files:
        raise UserError(f"--{flag} {folder} is a folder without frame images ({', '.join(FRAME_SUFFIXES)})")
    frames = [read_image(str(path), flag)[0] for path in files]
    sizes = {frame.size for frame in frames}
    if len(sizes) > 1:
        odd = next(path.name for path, frame in zip(files, frames, strict=True) if frame.size != frames[0].size)
        raise UserError(f"--{flag} {folder}: the frames differ in size ({odd} is not {files[0].name}'s)")
    width, height = frames[0].size
    return frames, {"frames": len(frames), "size": [height, width], "fps": None}
