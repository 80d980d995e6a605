"""Stage 1's image inputs for image-to-video: each file read and checked before any weights load, and
what stage 1 records about it (file name, sha256, original size; the family adds the processed size), and
stage 2's check that the size the image was encoded for is kept.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from utils import sha256_file

IMAGE_FLAGS = ("image", "last_image")  # stage 1's flags, in the order the pipelines take them
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


def read_images(paths: dict[str, str | None]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The given images by flag name, and their records for the stage-1 section (`size`: the one used,
    after the EXIF orientation)."""
    images, records = {}, {}
    for flag, path in paths.items():
        if path is None:
            continue
        images[flag], notes = read_image(path, flag)
        width, height = images[flag].size
        record = {"file": Path(path).name, "sha256": sha256_file(Path(path)), "size": [height, width]}
        records[flag] = {**record, **notes}
    return images, records


def check_image_flags(family, source, given: dict[str, str | None]) -> None:
    """Before any weights load: the images this model takes (family.image_inputs: the flags it accepts and
    whether `image` is required) against the ones given."""
    accepted, required = family.image_inputs(source)
    for flag in IMAGE_FLAGS:
        if given.get(flag) is not None and flag not in accepted:
            what = "takes no image (a text-to-video model)" if not accepted else f"takes no --{flag}"
            raise UserError(f"--{flag}: --model {source.ref!r} {what}")
    if required and given.get("image") is None:
        raise UserError(f"--model {source.ref!r} is an image-to-video model: give the first frame with --image PATH")


def check_image_size_kept(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Stage 2 of image-to-video: stage 1 encoded the image at the request's size and frame count; later
    stages cannot change them."""
    changed = [key for key in ("height", "width", "num_frames") if key in overrides]
    if config["stage1"].get("task") == "i2v" and changed:
        raise UserError(
            f"--{changed[0]}: stage 1 encoded the image for {config['height']}x{config['width']}, "
            f"{config['num_frames']} frames; rerun stage 1 to change the size or frame count"
        )
