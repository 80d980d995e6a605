"""Image inputs as cameras and editors write them (tpu_video/engine/images.py): EXIF orientation, 16-bit and float
pixels, palettes with transparency, a camera's multi-picture JPEG, TIFF and BMP, and the refusals (folders,
animations, images over Pillow's pixel limit) as one `error:` line before any weights load."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import stage1_text_encoder
from helpers import expect_user_error, run_stage
from tpu_video.engine import inputs
from tpu_video.engine.images import read_image
from utils import CONFIG_FILE, read_config, read_tensors

RNG = np.random.default_rng(7)
UPRIGHT = RNG.integers(0, 256, (40, 24, 3), dtype=np.uint8)  # a portrait picture, 24 wide and 40 high


def pixels(path) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of Pillow's raw warnings reach the user
        image, _ = read_image(str(path), "image")
    return np.asarray(image)


def png(path, width: int, height: int, depth: int, colour: int, rows: bytes = b"") -> None:
    """A PNG written chunk by chunk (Pillow writes no 16-bit RGB, and no header without its pixels)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("orientation, stored", [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270)])
def test_exif_orientation_gives_the_upright_picture(tmp_path, orientation, stored):
    """A phone stores a portrait photo landscape with an orientation tag: load_image's exif_transpose."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(UPRIGHT).transpose(stored).save(tmp_path / "photo.png", exif=exif)
    assert Image.open(tmp_path / "photo.png").size == (40, 24)  # stored landscape
    assert np.array_equal(pixels(tmp_path / "photo.png"), UPRIGHT)
    assert read_image(str(tmp_path / "photo.png"), "image")[1] == {"exif_orientation": orientation}


def test_16_bit_and_float_pixels_equal_their_8_bit_version(tmp_path):
    grey = UPRIGHT[..., 0]
    Image.fromarray(grey).save(tmp_path / "grey8.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "grey16.png")  # I;16: 257 k is k in 8 bits
    Image.fromarray(grey.astype(np.float32) / 255).save(tmp_path / "grey.tiff")  # F, in [0, 1]
    rgb16 = UPRIGHT.astype(">u2") * 257
    rows = b"".join(b"\x00" + row.tobytes() for row in rgb16)
    png(tmp_path / "rgb16.png", 24, 40, 16, 2, rows)
    assert Image.open(tmp_path / "grey16.png").mode == "I;16"
    assert np.array_equal(pixels(tmp_path / "grey16.png"), pixels(tmp_path / "grey8.png"))
    assert np.array_equal(pixels(tmp_path / "grey.tiff"), pixels(tmp_path / "grey8.png"))
    assert np.array_equal(pixels(tmp_path / "rgb16.png"), UPRIGHT)
    Image.fromarray(np.full((4, 4), 2.0, np.float32)).save(tmp_path / "bright.tiff")
    with pytest.raises(Exception, match=r"F pixels from 2 to 2, outside 0 to 1"):
        read_image(str(tmp_path / "bright.tiff"), "image")


def test_palette_with_transparency_tiff_bmp_and_a_camera_mpo(tmp_path):
    palette = Image.fromarray(UPRIGHT).quantize(16)
    palette.save(tmp_path / "palette.png", transparency=bytes(range(0, 256, 16)))
    assert isinstance(Image.open(tmp_path / "palette.png").info["transparency"], bytes)
    assert np.array_equal(pixels(tmp_path / "palette.png"), np.asarray(palette.convert("RGB")))
    for suffix in ("tiff", "bmp"):
        Image.fromarray(UPRIGHT).save(tmp_path / f"upright.{suffix}")
        assert np.array_equal(pixels(tmp_path / f"upright.{suffix}"), UPRIGHT)
    # A multi-picture JPEG (Pillow: MPO, 2 frames, "animated") is a JPEG: its primary picture.
    primary, second = Image.fromarray(UPRIGHT), Image.fromarray(255 - UPRIGHT)
    primary.save(tmp_path / "photo.jpg", quality=95)
    primary.save(tmp_path / "photo.mpo", "MPO", save_all=True, append_images=[second], quality=95)
    assert Image.open(tmp_path / "photo.mpo").format == "MPO"
    assert np.array_equal(pixels(tmp_path / "photo.mpo"), pixels(tmp_path / "photo.jpg"))


def test_between_pillows_warning_and_its_limit_an_image_reads_quietly(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 24 * 40 - 1)  # the picture is over it, under twice it
    Image.fromarray(UPRIGHT).save(tmp_path / "big.png")
    assert np.array_equal(pixels(tmp_path / "big.png"), UPRIGHT)
    assert Image.MAX_IMAGE_PIXELS == 24 * 40 - 1  # read_image put Pillow's setting back


def animated(path, fmt: str) -> None:
    frames = [Image.fromarray(UPRIGHT), Image.fromarray(255 - UPRIGHT)]
    frames[0].save(path, fmt, save_all=True, append_images=frames[1:])


@pytest.mark.parametrize(
    "name, message",
    [
        ("folder", "is a folder; give an image file"),
        ("bomb.png", "is 20000x20000 (400 Mpixel), over the 179 Mpixel an image may have"),
        ("moving.gif", "is an animated GIF (2 frames); give a still image"),
        ("moving.webp", "is an animated WEBP (2 frames); give a still image"),
        ("moving.png", "is an animated PNG (2 frames); give a still image"),
    ],
)
def test_refused_before_loading(capsys, tmp_path, no_weights_loaded, name, message):
    path = tmp_path / name
    if name == "folder":
        path.mkdir()
    elif name == "bomb.png":
        png(path, 20000, 20000, 8, 0)  # the header alone: refused before a pixel is decoded
    else:
        animated(path, {"gif": "GIF", "webp": "WEBP", "png": "PNG"}[path.suffix[1:]])
    out = tmp_path / "out"
    argv = ["--model", "tiny-wan2.1-i2v", "--prompt", "x", "--output_dir", out, "--image", path]
    expect_user_error(capsys, stage1_text_encoder, argv, message)
    assert not out.exists()


def test_an_exif_photo_conditions_like_its_upright_picture(tmp_path):
    """Through stage 1 (HunyuanVideo-1.5 picks its size bucket from the image): the portrait bucket, and the
    same files as the upright picture, the recorded orientation aside."""
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(UPRIGHT).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "photo.png", exif=exif)
    Image.fromarray(UPRIGHT).save(tmp_path / "upright.png")
    outputs = {}
    for name in ("photo", "upright"):
        out = tmp_path / f"out_{name}"
        argv = ["--model", "tiny-hunyuanvideo15-i2v", "--prompt", "x", "--output_dir", out]
        run_stage(stage1_text_encoder, [*argv, "--image", tmp_path / f"{name}.png"])
        config = read_config(out, needs="stage1")
        outputs[name] = config, read_tensors(out, config["stage1"])
    (photo, photo_tensors), (upright, upright_tensors) = outputs["photo"], outputs["upright"]
    assert photo["height"] > photo["width"]
    assert (photo["height"], photo["width"]) == (upright["height"], upright["width"])
    assert photo["stage1"]["inputs"]["image"]["exif_orientation"] == 6
    assert photo["stage1"]["inputs"]["image"]["size"] == upright["stage1"]["inputs"]["image"]["size"] == [40, 24]
    assert all(torch.equal(photo_tensors[key], upright_tensors[key]) for key in upright_tensors)
    assert (tmp_path / "out_photo" / CONFIG_FILE).is_file()


def test_an_image_fitted_to_another_aspect_ratio_is_said(capsys):
    records = {"image": {"kind": "image", "size": [240, 360]}, "last_image": {"kind": "image", "size": [40, 60]}}
    inputs.record_processed_size(records, 64, 64)
    assert records["image"]["processed_size"] == [64, 64]
    out = capsys.readouterr().out
    assert "--image: the 240x360 image (height x width) is fitted to the requested 64x64" in out
    inputs.record_processed_size({"image": {"kind": "image", "size": [40, 60]}}, 32, 48)  # the same shape, smaller
    assert capsys.readouterr().out == ""
