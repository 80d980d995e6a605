"""The image reader of stage 1's image inputs (inputs.py): a file read as diffusers' load_image reads it,
checked before any weights load, with what the record notes about it (the EXIF orientation applied, the
pixel mode converted from).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError

EXIF_ORIENTATION = 0x0112  # the EXIF tag cameras set instead of rotating the pixels


def read_image(path: str, flag: str):
    """The image at `path` as diffusers' `load_image` sees it (EXIF orientation applied, then RGB), and what
    the stage-1 record adds about it; or one UserError naming the file: a folder, missing, empty, not an
    image, animated, over Pillow's pixel limit, or truncated. Any still format Pillow reads is taken; a
    camera's multi-picture JPEG (MPO) gives its primary picture; 16-bit and float pixels are scaled to
    8 bits (a plain conversion would clip them)."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if file.is_dir():
        raise UserError(f"--{flag} {path} is a folder; give an image file")
    if not file.is_file():
        raise UserError(f"--{flag} {path}: no such file")
    if file.stat().st_size == 0:
        raise UserError(f"--{flag} {path} is empty (0 bytes)")
    limit = 2 * Image.MAX_IMAGE_PIXELS  # where Pillow itself refuses a file as a decompression bomb
    try:
        with _size_checked_here(Image), Image.open(file) as image:
            width, height = image.size
            if width * height > limit:
                raise UserError(
                    f"--{flag} {path} is {width}x{height} ({width * height / 1e6:.0f} Mpixel), over the "
                    f"{limit / 1e6:.0f} Mpixel an image may have (Pillow's decompression-bomb limit); scale it down"
                )
            if getattr(image, "is_animated", False) and image.format != "MPO":  # MPO: frame 0 is the photo
                raise UserError(
                    f"--{flag} {path} is an animated {image.format} ({image.n_frames} frames); give a still image"
                )
            image.load()  # decodes every byte: a truncated file fails here, not in the pipeline
            return _upright_rgb(image, flag, path)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UserError(f"--{flag} {path} is not a readable image ({type(err).__name__}: {err})") from None


@contextlib.contextmanager
def _size_checked_here(Image):
    """Pillow's own pixel check off while we read (read_image checks the size and words the error): above
    MAX_IMAGE_PIXELS Pillow prints a raw warning, above twice that it raises from deep inside `open`."""
    saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _upright_rgb(image, flag: str, path: str):
    """`load_image`'s steps (exif_transpose, convert("RGB")) with 16-bit, 32-bit and float pixels scaled to
    8 bits first, and the notes the record keeps: the EXIF orientation applied, the mode converted from."""
    import numpy as np
    from PIL import Image, ImageOps

    notes: dict[str, Any] = {}
    orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    if orientation != 1:
        notes["exif_orientation"] = orientation
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":
        pixels = np.asarray(image, dtype=np.float64)
        low, high = (0.0, 1.0) if image.mode == "F" else (0.0, 65535.0)
        if pixels.size and (pixels.min() < low or pixels.max() > high):
            raise UserError(
                f"--{flag} {path}: {image.mode} pixels from {pixels.min():g} to {pixels.max():g}, outside "
                f"{low:g} to {high:g}; save it as an 8- or 16-bit image"
            )
        notes["converted_from"] = image.mode
        image = Image.fromarray(np.round(pixels * (255.0 / high)).astype(np.uint8), "L")
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow warns about the direct conversion; the colours are the same
    return image.convert("RGB"), notes
