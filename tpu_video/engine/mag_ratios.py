"""MagCache's magnitude-ratio files: what `--cache_calibrate` writes (tpu_video/engine/step_cache.py) and `--cache
magcache` reads, with what they were calibrated for: the model, its LoRA adapters and its quantization. A
model changed any of those ways has other ratios, so a file of another is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from utils import non_finite_keys

MAG_RATIOS_FILE = "mag_ratios.json"


def read_mag_ratios(
    path: Path, model_id: str | None = None, adapters: list | None = None, quantize: dict | None = None
) -> Any:
    """`--cache_mag_ratios FILE`: a JSON list of numbers (diffusers' `mag_ratios`, for every state), or
    the file --cache_calibrate writes ({"mag_ratios": {state: list}, "model": ..., "adapters": [...],
    "quantize": {...}}), which must be of this model with these LoRA adapters (engine.lora.identity) and this
    `--quantize` (engine.settings.Quantization.calibration_key; a file without a key had none)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"--cache_mag_ratios {path}: cannot be read ({err})") from None
    if bad := non_finite_keys(data):
        raise UserError(f"--cache_mag_ratios {path}: {', '.join(bad)} is NaN or infinite")
    ratios = data.get("mag_ratios") if isinstance(data, dict) else data
    lists = ratios.values() if isinstance(ratios, dict) else [ratios]
    if not lists or not all(isinstance(v, list) and v and all(_is_number(x) for x in v) for v in lists):
        raise UserError(f"--cache_mag_ratios {path}: expected a list of numbers or a {MAG_RATIOS_FILE} file")
    if isinstance(data, dict) and model_id and data.get("model") not in (None, model_id):
        raise UserError(f"--cache_mag_ratios {path} was calibrated on {data['model']}, not {model_id}")
    if isinstance(data, dict) and adapters is not None and data.get("adapters", []) != adapters:
        had = f"LoRA adapters {data['adapters']}" if data.get("adapters") else "no LoRA adapter"
        raise UserError(
            f"--cache_mag_ratios {path} was calibrated with {had}; this run fuses "
            f"{adapters or 'none'}: calibrate again with this run's --lora flags (--cache_calibrate)"
        )
    if isinstance(data, dict) and quantize is not None and data.get("quantize") != (quantize or None):
        had = f"--quantize {data['quantize']}" if data.get("quantize") else "unquantized weights"
        raise UserError(
            f"--cache_mag_ratios {path} was calibrated with {had}; this run has "
            f"{quantize or 'unquantized weights'}: calibrate again with this run's --quantize (--cache_calibrate)"
        )
    return ratios


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
