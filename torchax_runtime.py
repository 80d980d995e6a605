"""Running stock PyTorch modules on a JAX device through torchax: the one place that sets up its environment.

Stage 2 (and stage 3's `--backend torchax`) hand modules to `TorchaxRuntime.compile`, which moves the
weights to the JAX device and returns the module's forward under `jax.jit`. Attention is torchax's
lowering of `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from torchax_compat import import_torchax

torchax = import_torchax()


class TorchaxRuntime:
    """Moves modules and tensors to the default JAX device and jits module forwards."""

    name = "torchax"

    def __init__(self) -> None:
        self.env = torchax.default_env()

    @property
    def device_description(self) -> dict[str, object]:
        devices = jax.devices()
        return {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "device_count": len(devices)}

    def compile(self, module: torch.nn.Module):
        """The module's weights on the JAX device, its forward jitted (traced on first call)."""
        with self.env:
            module.to("jax")
        return torchax.compile(module)

    def to_device(self, tree):
        with self.env:
            return torch.utils._pytree.tree_map(lambda t: t.to("jax") if torch.is_tensor(t) else t, tree)

    def to_host(self, tensor) -> torch.Tensor:
        """A CPU torch tensor; blocks until the device has computed it."""
        array = np.array(jax.device_get(tensor.jax()))  # a writable host copy
        if array.dtype == jax.numpy.bfloat16:  # numpy has no bf16 that torch reads: move the bits as uint16
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)
