"""The engine features' settings as stage 2's flags choose them, with no torch imported: the stages'
parsers read these choices, and `--help` and argument errors must come before torch loads (a second or
more on a busy host). What each setting does is in the module named beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_video.cli import UserError

# LoRA (engine.lora): each adapter flag and the transformer component it adapts.
LORA_FLAGS = {"--lora": "transformer", "--lora_2": "transformer_2"}

# The block scan (engine.scanned_blocks): `--scan_blocks`.
SCAN_CHOICES = ("auto", "on", "off")

# Quantized weights (engine.quantize): `--quantize` and `--quantize_layers`.
SCHEMES = ("none", "int8_weight", "int8", "fp8_weight")
LAYER_SETS = ("all", "ffn", "attention")


@dataclass(frozen=True)
class Quantization:
    """`--quantize` and `--quantize_layers` as a run applies them (engine.quantize.quantize)."""

    scheme: str = "none"
    layers: str = "all"

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    def record(self) -> dict[str, str]:
        """What the stage-2 section records and a checkpoint's fingerprint compares."""
        return {"scheme": self.scheme, "layers": self.layers}

    def calibration_key(self) -> dict[str, str]:
        """What a MagCache calibration file records of the weights' quantization (empty: none)."""
        return self.record() if self.enabled else {}

    def check_supported(self) -> None:
        """fp8 needs a JAX that stores e4m3 arrays (before any weights load)."""
        if self.scheme != "fp8_weight":
            return
        import jax.numpy as jnp

        if not hasattr(jnp, "float8_e4m3fn"):
            raise UserError("--quantize fp8_weight: the installed JAX cannot store float8_e4m3fn arrays")


NO_QUANTIZATION = Quantization()
