"""Making the dp/sp/tp JAX mesh and placing weights and activations on it: where sharding.py's layouts
(tuples of axis names) become `PartitionSpec`s and `NamedSharding`s.

An axis that does not divide a dimension is dropped from it (`fit_spec`), so one layout serves every
mesh: that dimension is then replicated.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import AXES, REPLICATED, Layout, MeshShape, RuleTable
from tpu_video.cli import UserError

P = PartitionSpec


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The dp/sp/tp mesh over `devices` (default: all), host by host, so the innermost axis (tp) stays
    within one host wherever it divides a host's devices (runtime.mesh.default_mesh)."""
    devices = sorted(
        jax.devices() if devices is None else devices, key=lambda device: (device.process_index, device.id)
    )
    return Mesh(np.array(devices[: shape.size]).reshape(shape.dp, shape.sp, shape.tp), AXES)


def fit_spec(layout: Layout | PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """`layout` as a PartitionSpec, with each mesh axis dropped from a dimension it does not divide; that
    dimension is then replicated."""
    fitted = []
    for dim, axes in zip(shape, tuple(layout) + (None,) * (len(shape) - len(layout)), strict=False):
        fitted.append(axes if axes and dim % axes_size(mesh, axes) == 0 else None)
    return P(*fitted)


# torch dtypes as JAX holds them: JAX runs without x64, as torchax does, so 64-bit types narrow.
JAX_DTYPES = {
    torch.float32: jax.numpy.float32,
    torch.float64: jax.numpy.float32,
    torch.bfloat16: jax.numpy.bfloat16,
    torch.float16: jax.numpy.float16,
    torch.int64: jax.numpy.int32,
    torch.int32: jax.numpy.int32,
    torch.int8: jax.numpy.int8,
    torch.float8_e4m3fn: jax.numpy.float8_e4m3fn,
    torch.bool: jax.numpy.bool_,
}


def abstract(shape: Sequence[int], dtype, layout: Layout = REPLICATED, *, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """What an array placed on `mesh` as `layout` looks like to the compiler: shape, dtype (torch or JAX)
    and sharding, no data. The planner and the collective counts compile over these."""
    shape = tuple(shape)
    return jax.ShapeDtypeStruct(
        shape, JAX_DTYPES.get(dtype, dtype), sharding=NamedSharding(mesh, fit_spec(layout, shape, mesh))
    )


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor without copying (bf16 and fp8, which NumPy lacks, through their bits)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(jax.numpy.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().view(jax.numpy.float8_e4m3fn)
    return tensor.numpy()


def _place_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Each device receives only its own slice, so no full extra copy is made on the way."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _read_array(tensor: torch.Tensor, sharding: NamedSharding) -> tuple[jax.Array, bool]:
    """A meta tensor's values read from its checkpoint file (its `file_source`, tpu_video/engine/direct_load.py), each
    distinct slice once (replicas share it), straight into the devices that hold it; and whether every slice read
    was free of NaN and Inf."""
    source = getattr(tensor, "file_source", None)
    if source is None:
        raise ValueError(f"a meta tensor of shape {tuple(tensor.shape)} has no values to place")
    read: dict[tuple, np.ndarray] = {}
    finite = True

    def slice_of(index: tuple[slice, ...]) -> np.ndarray:
        nonlocal finite
        key = tuple((part.start, part.stop, part.step) for part in index)
        if key not in read:
            values = source.read(index)
            finite = finite and not holds_nonfinite(values)
            read[key] = _host_array(values)
        return read[key]

    array = jax.make_array_from_callback(tuple(tensor.shape), sharding, slice_of)
    return array, finite


def holds_nonfinite(tensor: torch.Tensor) -> bool:
    """Whether a host tensor holds a NaN or an Inf. A NaN or an Inf makes the sum non-finite, and torch sums a
    bf16 tensor 40x quicker than it tests every element (0.02 against 0.86 s for 512 MiB on our 2-core
    machine); a sum that is not finite is confirmed element by element, so a finite tensor whose sum
    overflows is not taken for a damaged one."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    if tensor.element_size() == 1:  # fp8: torch does not sum it (float32 holds every 1-byte format's range)
        tensor = tensor.to(torch.float32)
    return not torch.isfinite(tensor.sum()).item() and not torch.isfinite(tensor).all().item()


def place_module(module: torch.nn.Module, table: RuleTable, mesh: Mesh, env) -> dict[str, object]:
    """Replace the module's CPU weights, one at a time, by torchax tensors sharded by `table` (weights
    already placed that way are kept as they are; meta weights are read from their files, `_read_array`).

    Each CPU tensor is released as soon as its device copy exists, so host memory stays near one copy
    of the weights. Tied weights (one tensor under several names, e.g. T5's `shared` and
    `encoder.embed_tokens`) stay one device array. Buffers are replicated. Returns the rule table's
    name, counts (of them, how many were read from files), per-device bytes (the caller logs and
    records them). A floating-point weight holding NaN or Inf, each checked on the host as it is placed
    (`holds_nonfinite`), is a UserError naming them all, so a damaged checkpoint is named before anything is
    compiled or run.
    """
    from torchax.tensor import Tensor

    stats = {"rule_table": table.name, "sharded": 0, "replicated": 0, "buffers": 0, "bytes_per_device": 0}
    stats["read_from_files"] = 0  # weights read straight from their checkpoint files to the devices
    nonfinite: list[str] = []  # names of the weights that hold NaN or Inf
    placed: dict[int, tuple] = {}  # id of a CPU tensor -> (a weak reference to it, its device copy)
    bar = _progress(module)
    for kind, name, store, leaf, value, spec in _weights(module, table, mesh):
        size = value.numel() * value.element_size()
        known, device_copy = placed.get(id(value), (None, None))
        if known is not None and known() is value:  # the weak reference: ids of freed tensors recur
            store[leaf] = device_copy
            bar.update(size)
            continue
        target = NamedSharding(mesh, spec)
        if isinstance(value, Tensor) and value.jax().sharding.is_equivalent_to(target, value.ndim):
            array = value.jax()  # placed before, as wanted (stage 3 reusing one VAE): kept, no host trip
        elif value.is_meta:
            array, finite = _read_array(value, target)
            stats["read_from_files"] += 1
            if not finite:
                nonfinite.append(name)
        else:
            if holds_nonfinite(value):
                nonfinite.append(name)
            array = _place_array(_host_array(value), target)
        store[leaf] = device_copy = Tensor(array, env)
        placed[id(value)] = (weakref.ref(value), device_copy)
        del value
        stats["bytes_per_device"] += array.addressable_shards[0].data.nbytes
        if kind == "buffer":
            stats["buffers"] += 1
        elif any(axis is not None for axis in spec):
            stats["sharded"] += 1
        else:
            stats["replicated"] += 1
        bar.update(size)
    bar.close()
    if nonfinite:
        shown = ", ".join(nonfinite[:5]) + (f" and {len(nonfinite) - 5} more" if len(nonfinite) > 5 else "")
        raise UserError(
            f"{len(nonfinite)} weight(s) of the {type(module).__name__} hold NaN or Inf values: {shown} "
            "(a damaged or wrongly converted checkpoint)"
        )
    return stats


def _progress(module: torch.nn.Module):
    """A progress bar over the module's weight bytes, shown where placing takes a while (from 256 MiB on: a
    large model read from its files as it is placed)."""
    from tqdm import tqdm

    from tpu_video.cli import logging_enabled

    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in named)  # as _weights yields them
    quiet = not logging_enabled() or total < 2**28
    return tqdm(total=total, desc="placing weights", unit="B", unit_scale=True, unit_divisor=1024, disable=quiet)


def abstract_weights(module: torch.nn.Module, table: RuleTable, mesh: Mesh) -> dict[int, jax.ShapeDtypeStruct]:
    """What place_module makes of each weight, by the id of its tensor, without data: the arguments a plan
    (tpu_video/planning/plan.py) compiles a meta-device module's programs over, laid out exactly as a run's."""
    found: dict[int, jax.ShapeDtypeStruct] = {}
    for _, _, _, _, value, spec in _weights(module, table, mesh):
        if id(value) not in found:  # tied weights: the first name's layout, as place_module keeps one copy
            found[id(value)] = jax.ShapeDtypeStruct(
                value.shape, JAX_DTYPES.get(value.dtype, value.dtype), sharding=NamedSharding(mesh, spec)
            )
    return found


def _weights(module: torch.nn.Module, table: RuleTable, mesh: Mesh):
    """(kind, full name, the dict holding it, its name there, tensor, PartitionSpec) of every parameter ("param": laid
    out by `table`), then every buffer ("buffer": replicated), module by module."""
    specs = table.assign([name for name, _ in module.named_parameters(remove_duplicate=False)])
    for kind, store in (("param", "_parameters"), ("buffer", "_buffers")):
        for owner_name, owner in module.named_modules():
            for leaf, value in list(getattr(owner, store).items()):
                if value is None or not isinstance(value, torch.Tensor):
                    continue
                full_name = f"{owner_name}.{leaf}" if owner_name else leaf
                spec = specs.get(full_name, REPLICATED) if kind == "param" else REPLICATED
                yield kind, full_name, getattr(owner, store), leaf, value, fit_spec(spec, value.shape, mesh)


def place(tree, mesh: Mesh, layout: Layout, env):
    """torchax tensors for the CPU tensors in `tree`, each laid out as `layout` (axes it cannot divide dropped)."""
    from torchax.tensor import Tensor

    def one(value):
        if not isinstance(value, torch.Tensor):
            return value
        sharding = NamedSharding(mesh, fit_spec(layout, value.shape, mesh))
        return Tensor(_place_array(_host_array(value.contiguous()), sharding), env)

    return torch.utils._pytree.tree_map(one, tree)


def constraint_spec(layout: Layout | PartitionSpec, shape: Sequence[int], mesh: Mesh, uneven: bool) -> PartitionSpec:
    """`layout` for a constraint inside a compiled program: `fit_spec`, or with `uneven` each axis kept where the
    dimension is at least the axis size, divided or not: XLA's partitioner then pads the last shards (jit's
    arguments and results must divide; a constraint inside may not)."""
    if not uneven:
        return fit_spec(layout, shape, mesh)
    dims = zip(shape, tuple(layout), strict=False)  # a spec may name fewer dimensions than the tensor has
    return P(*(axes if axes is None or dim >= axes_size(mesh, axes) else None for dim, axes in dims))


def axes_size(mesh: Mesh, axes: str | Sequence[str]) -> int:
    """The devices along one mesh axis or a tuple of them."""
    return math.prod(mesh.shape[name] for name in ((axes,) if isinstance(axes, str) else axes))


def constrain(tensor: torch.Tensor, mesh: Mesh, layout: Layout, uneven: bool = False) -> torch.Tensor:
    """A sharding constraint on a traced torchax tensor (`constraint_spec`)."""
    from torchax.interop import call_jax

    sharding = NamedSharding(mesh, constraint_spec(layout, tensor.shape, mesh, uneven))
    return call_jax(jax.lax.with_sharding_constraint, tensor, sharding)
