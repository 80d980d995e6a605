"""Running stock PyTorch modules on JAX devices through torchax: the one place that sets up its environment.

Stage 2 (and stages 1 and 3 with `--backend torchax`) hand modules to `TorchaxRuntime.compile`, which
places the weights on the runtime's mesh by a rule table (sharding.py) and returns the module's forward
under `jax.jit`. Attention is torchax's lowering of `torch.nn.functional.scaled_dot_product_attention`
unless splash_attention.attention_backend overrides it; `torch.gather` is lowered by
`take_along_axis_gather` (see there).
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import Mesh, PartitionSpec

import sharding
from torchax_compat import import_torchax

torchax = import_torchax()


def take_along_axis_gather(stock_gather):
    """`aten.gather` as `jnp.take_along_axis` when the index has the input's shape outside `dim`.

    torchax 0.0.13 lowers gather to advanced indexing over a full index grid. On a batch sharded over
    `dp`, XLA's partitioner then adds 2 all-reduces and 2 collective-permutes to HunyuanVideo-1.5's
    per-sample token reorder, which `take_along_axis` (the same values) compiles without. Other index
    shapes keep torchax's lowering (`stock_gather`, a JAX function). tests/test_torchax_compat.py shows
    both the values and the collectives, and fails once torchax's own lowering stops adding them.
    """
    from torchax.interop import call_jax

    def gather(input, dim, index, *, sparse_grad=False):
        dim = dim % max(input.ndim, 1)
        outside = [d for d in range(input.ndim) if d != dim]
        if input.ndim and input.ndim == index.ndim and all(input.shape[d] == index.shape[d] for d in outside):
            return call_jax(lambda x, i: jax.numpy.take_along_axis(x, i, axis=dim), input, index)
        return call_jax(stock_gather, input, dim, index)

    gather.stock_gather = stock_gather
    return gather


def _install_gather(env) -> None:
    current = env._ops[torch.ops.aten.gather]  # private table: the public override has no getter
    if not hasattr(current.func, "stock_gather"):  # installed once per environment
        env.override_op_definition(torch.ops.aten.gather, take_along_axis_gather(current.func))


class TorchaxRuntime:
    """Places modules and tensors on a JAX device mesh and jits module forwards."""

    name = "torchax"
    device = torch.device("cpu")  # callers' torch tensors: they reach and leave the mesh through the host

    def __init__(self, mesh: Mesh | None = None, profile_dir: str | None = None) -> None:
        self.env = torchax.default_env()
        _install_gather(self.env)
        self.mesh = mesh if mesh is not None else sharding.make_mesh(sharding.MeshShape())
        self.placements: list[dict[str, object]] = []  # every compiled module's, in order
        self.profile_dir = profile_dir

    def profile_trace(self):
        """A JAX profiler trace context writing to `profile_dir` (view with TensorBoard/XProf), or None."""
        return jax.profiler.trace(self.profile_dir) if self.profile_dir else None

    @property
    def device_description(self) -> dict[str, object]:
        devices = self.mesh.devices.flatten()
        return {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "mesh": dict(self.mesh.shape),
        }

    @property
    def placement(self) -> dict[str, object]:
        """The last compiled module's placement record (stage 2 compiles one module)."""
        return self.placements[-1] if self.placements else {}

    def compile(self, module: torch.nn.Module, rules: sharding.RuleTable | None = None):
        """The module's weights placed on the mesh by `rules` (default: replicated), its forward jitted."""
        self.placements.append(sharding.place_module(module, rules or sharding.REPLICATED_TABLE, self.mesh, self.env))
        return torchax.compile(module)

    def to_device(self, tree, spec: PartitionSpec = sharding.REPLICATED):
        """The CPU tensors in `tree` as torchax tensors laid out as `spec` on the mesh."""
        return sharding.place(tree, self.mesh, spec, self.env)

    def constrain(self, tensor: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """Inside a compiled forward: pin an activation's layout (e.g. the CFG batch on `dp`)."""
        return sharding.constrain(tensor, self.mesh, spec)

    def to_host(self, tensor) -> torch.Tensor:
        """A CPU torch tensor; blocks until the device has computed it."""
        array = np.array(jax.device_get(tensor.jax()))  # a writable host copy
        if array.dtype == jax.numpy.bfloat16:  # numpy has no bf16 that torch reads: move the bits as uint16
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)
