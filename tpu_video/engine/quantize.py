"""Quantized transformer weights for stage 2 (`--quantize`, `--quantize_layers`; docs/quantization.md).

The schemes (chosen as engine.settings.Quantization) are torchao 0.18's, computed here in plain torch ops
so torchax runs them and the rule tables place them (torchao's tensor subclasses do neither);
tests/test_quantize.py checks integers, scales and outputs against torchao itself:

- `int8_weight` (torchao `Int8WeightOnlyConfig`): per output channel, scale = max |w| / 127.5 (in the
  weight's dtype, clamped to float32's eps, kept in float32), q = clamp(round(w * (1 / scale)), -128, 127);
  y = (x @ q^T in x's dtype) * scale.
- `int8` (`Int8DynamicActivationInt8WeightConfig`): the same weights, and each token's activations quantized
  by the same rule at run time; y = ((x_q @ q^T in int32) * x_scale, in x's dtype) * scale.
- `fp8_weight` (`Float8WeightOnlyConfig`, e4m3): scale = max |w| / 448 in float32, q = e4m3(w / scale);
  y = (x @ q^T in x's dtype) * scale (torchao dequantizes the weight first: the same values in float32; a
  row of zeros, NaN in torchao, stays zero here).

Only the linears inside the transformer blocks are quantized (`--quantize_layers`): all of them (attention,
feed-forward, and the adaptive norms' modulation linears, a third of HunyuanVideo-1.5's weights), or the
feed-forward or attention ones alone; embeddings, norms' own weights, modulation tables (Wan's
`scale_shift_table`) and the output projection stay as they are. Quantizing runs on the host after LoRA fusion
and before placement, a linear at a time (each one's original weight freed as it goes); the integers are
stored under the linear's own `weight` name and the scale as `weight_scale`, which sharding.RuleTable lays out
as the weight's output dimension. Applied to meta-device modules it gives the quantized shapes and dtypes,
which the mesh choice and `--plan` count.
"""

from __future__ import annotations

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.settings import Quantization

INT8_EPS = torch.finfo(torch.float32).eps  # torchao's Int8Tensor.from_hp: float32's eps for every dtype
FP8 = torch.float8_e4m3fn
# Activations (`int8`) use max |x| / 127, not torchao's 127.5: with 127.5 each row's largest negative value
# lands exactly on a rounding tie (-127.5), so its integer, and the result, follow the last bit of every input
# (docs/quantization.md: one tiny Wan 2.1 forward moved by 2.4e-4 relative when only the rescale's rounding
# changed; 1.1e-7 with 127). Weights are quantized once, on the host, so they keep torchao's rule.
ACTIVATION_LEVELS = 127.0


def int8_per_row(tensor: torch.Tensor, levels: float = 127.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale with a trailing 1) with one scale per row (the last dimension reduced):
    torchao's symmetric int8 rule, as in the module docstring, with scale = max |x| / `levels`."""
    scale = tensor.abs().amax(dim=-1, keepdim=True) / levels  # in the tensor's dtype, as torchao computes it
    scale = torch.clamp(scale, min=INT8_EPS).to(torch.float32)
    values = torch.clamp(torch.round(tensor * (1.0 / scale)), -128, 127).to(torch.int8)
    return values, scale


def fp8_per_row(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale with a trailing 1), one scale per row: torchao's `_choose_scale_float8`
    and `_quantize_affine_float8`, but for a row of zeros, which torchao turns into NaN (0 / 0) and this
    keeps at zero (its scale clamped to float32's smallest normal)."""
    limit = torch.finfo(FP8).max
    scale = (tensor.abs().amax(dim=-1, keepdim=True) / limit).to(torch.float32)
    scale = torch.clamp(scale, min=torch.finfo(torch.float32).tiny)
    values = (tensor.to(torch.float32) / scale).clamp(min=-limit, max=limit).to(FP8)
    return values, scale


class QuantizedLinear(torch.nn.Module):
    """An `nn.Linear` with quantized weights: `weight` (int8 or e4m3, the linear's shape) and `weight_scale`
    (float32, one per output channel), both parameters so the rule tables place them; `bias` as it was."""

    def __init__(self, linear: torch.nn.Linear, scheme: str) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        values, scale = fp8_per_row(weight) if scheme == "fp8_weight" else int8_per_row(weight)
        self.weight = torch.nn.Parameter(values, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.reshape(-1), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features)
        if self.scheme == "int8":
            values, scale = int8_per_row(rows, ACTIVATION_LEVELS)
            y = (torch._int_mm(values, self.weight.t()) * scale).to(dtype) * self.weight_scale
        else:
            y = torch.mm(rows, self.weight.t().to(dtype)) * self.weight_scale.to(dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def layer_kind(module: torch.nn.Module) -> str | None:
    """ "attention" or "ffn" for the modules whose linears `--quantize_layers` selects, else None."""
    from diffusers.models.attention import AttentionModuleMixin, FeedForward
    from diffusers.models.attention_processor import Attention

    if isinstance(module, FeedForward):
        return "ffn"
    if isinstance(module, (Attention, AttentionModuleMixin)):
        return "attention"
    return None


def selected_linears(transformer: torch.nn.Module, layers: str) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute) of every linear in the transformer's blocks that `layers` selects: its list of
    blocks and every other list of blocks directly under it (Wan VACE's `vace_blocks`)."""
    from tpu_video.engine.cached_blocks import block_list

    found: dict[int, tuple[torch.nn.Module, str]] = {}  # by the linear's id: a nested module is met twice
    blocks = block_list(transformer)
    others = [
        child for child in transformer.children() if isinstance(child, torch.nn.ModuleList) and child is not blocks
    ]
    for block in [*blocks, *(block for other in others for block in other)]:
        for selected in block.modules():
            if layers != "all" and layer_kind(selected) != layers:
                continue
            for parent in selected.modules():
                for name, child in parent.named_children():
                    if type(child) is torch.nn.Linear:
                        found.setdefault(id(child), (parent, name))
    return list(found.values())


def quantize(transformers: dict[str, torch.nn.Module], quantization: Quantization) -> None:
    """Replace the selected linears of each transformer in place (a no-op for `none`), logging what it did
    (meta-device modules, shapes only, quietly)."""
    if not quantization.enabled:
        return
    for name, transformer in transformers.items():
        linears = selected_linears(transformer, quantization.layers)
        if not linears:
            raise UserError(f"--quantize_layers {quantization.layers}: {name} has no such linears in its blocks")
        before = after = 0
        for parent, attribute in linears:
            linear = getattr(parent, attribute)
            quantized = QuantizedLinear(linear, quantization.scheme)
            setattr(parent, attribute, quantized)
            before += linear.weight.numel() * linear.weight.element_size()
            after += sum(p.numel() * p.element_size() for p in (quantized.weight, quantized.weight_scale))
        if not quantized.weight.is_meta:
            log(
                f"{name}: {len(linears)} linears quantized ({quantization.scheme}, {quantization.layers}): "
                f"{before / 2**20:.1f} MiB of weights -> {after / 2**20:.1f} MiB"
            )
