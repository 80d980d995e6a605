"""LTX-2's H.264 round trip of a conditioning image (image-to-video's `--image`, a one-frame `--condition`): the
pipelines re-encode it at `--image_crf` with diffusers' own helper, as the model was trained, which needs PyAV."""

from __future__ import annotations

import importlib.util

from tpu_video.cli import UserError


def check_h264_size(crf: int, image, flag: str) -> None:
    """An image to re-encode (crf > 0): PyAV is installed, and the image has the 2 x 2 pixels H.264 needs."""
    if crf:
        require_pyav(crf)
        width, height = image.size
        if min(width, height) < 2:
            raise UserError(
                f"{flag} is {width}x{height} pixels: H.264 (--image_crf {crf}) needs at least 2 "
                "on each side; pass --image_crf 0 to condition on the image as it is"
            )


def require_pyav(crf: int) -> None:
    """PyAV's libx264, which diffusers' helper uses, is an extra (`pip install -e ".[crf]"`): its wheels
    carry GPL x264."""
    if importlib.util.find_spec("av") is None:
        raise UserError(
            f'--image_crf {crf}: re-encoding the image needs PyAV (pip install -e ".[crf]"), or pass --image_crf 0 '
            "to condition on the image as it is (not how LTX-2 was trained)"
        )


def recompress(image, crf: int):
    """The image after the pipeline's H.264 round trip at `crf` (0: unchanged)."""
    import numpy as np
    from PIL import Image

    if crf == 0:
        return image
    require_pyav(crf)
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

    return Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
