"""Stage 1's image inputs for image-to-video: each file read and checked before any weights load, and
what stage 1 records about it (file name, sha256, original size; the family adds the processed size), and
stage 2's check that the size the image was encoded for is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli import UserError
from utils import sha256_file

IMAGE_FLAGS = ("image", "last_image")  # stage 1's flags, in the order the pipelines take them
FORMATS = ("PNG", "JPEG", "WEBP")


def read_image(path: str, flag: str):
    """The image at `path` as RGB (PIL), or one UserError naming the file: missing, empty, not an image,
    a format other than PNG/JPEG/WebP, or truncated."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--{flag} {path}: no such file")
    if file.stat().st_size == 0:
        raise UserError(f"--{flag} {path} is empty (0 bytes)")
    try:
        with Image.open(file) as image:
            if image.format not in FORMATS:
                raise UserError(f"--{flag} {path} is a {image.format} image; give a PNG, JPEG or WebP file")
            image.load()  # decodes every byte: a truncated file fails here, not in the pipeline
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise UserError(f"--{flag} {path} is not a readable image ({type(err).__name__}: {err})") from None


def read_images(paths: dict[str, str | None]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The given images by flag name, and their records for the stage-1 section."""
    images, records = {}, {}
    for flag, path in paths.items():
        if path is None:
            continue
        images[flag] = read_image(path, flag)
        width, height = images[flag].size
        records[flag] = {"file": Path(path).name, "sha256": sha256_file(Path(path)), "size": [height, width]}
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
