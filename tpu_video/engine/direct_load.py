"""Stage 2's transformers read from their safetensors files straight onto the devices.

`from_pretrained` reads every weight into host memory before anything is placed. When nothing must change
the weights on the host first (no LoRA adapter to fuse, no quantization), `load_direct` builds the module
as `from_pretrained` does, but with its parameters on the meta device, each carrying a `FileSlices` (as
attribute `file_source`) that says where its values lie. Placement (tpu_video/runtime/placement.py) then reads each
device's slice of each weight from the file as it places it, and the block scan (tpu_video/engine/scanned_blocks.py)
stacks sources, not values: the host never holds more than one weight's slices at a time.

The result is what `from_pretrained` loads, bit for bit: the same construction, names, dtypes (modules the
class keeps in fp32 stay fp32) and conversions (tests/test_direct_load.py). A checkpoint this cannot
promise that for (names or shapes that differ from the module's, tied weights, no safetensors files) is
loaded by `from_pretrained`, and the log says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tpu_video.cli import UserError, log

SAFETENSORS_NAME = "diffusion_pytorch_model.safetensors"


class CheckpointFiles:
    """The open safetensors files of one component (memory-mapped by safetensors; nothing is read until a
    slice is asked for)."""

    def __init__(self, paths: list[str]) -> None:
        from safetensors import SafetensorError, safe_open

        self.handles = {}
        for path in paths:
            try:
                self.handles[path] = safe_open(path, framework="pt")
            except SafetensorError as error:  # empty, truncated, a header that is not JSON
                raise UserError(
                    f"{path} is not a readable safetensors file ({error}); the checkpoint is damaged"
                ) from None

    def entries(self) -> dict[str, tuple[str, list[int], str]]:
        """Every tensor's name -> (file, shape, dtype as the file names it)."""
        found = {}
        for path, handle in self.handles.items():
            for key in handle.keys():
                tensor = handle.get_slice(key)
                found[key] = (path, tensor.get_shape(), tensor.get_dtype())
        return found


@dataclass(frozen=True)
class FileSlices:
    """One checkpoint tensor, not read yet: `read(index)` reads the slice `index` (a tuple of slices, one per
    dimension, as jax.make_array_from_callback passes it) and converts it to `dtype` as from_pretrained
    converts the whole tensor (elementwise, so a slice's values are the whole tensor's)."""

    files: CheckpointFiles
    path: str
    key: str
    dtype: torch.dtype

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        handle = self.files.handles[self.path]
        if not index:  # a scalar
            return handle.get_tensor(self.key).to(self.dtype)
        return handle.get_slice(self.key)[index].to(self.dtype)


@dataclass(frozen=True)
class StackedSlices:
    """Several blocks' tensors of one name stacked along a new first dimension (the block scan's weights),
    not read yet: `read` reads each selected block's slice."""

    parts: tuple

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        blocks = range(*index[0].indices(len(self.parts)))
        return torch.stack([self.parts[block].read(index[1:]) for block in blocks])


def stacked_source(tensors: list[torch.Tensor]) -> StackedSlices | None:
    """The stacked source of meta tensors that each carry one (None: they hold values on the host)."""
    sources = [getattr(tensor, "file_source", None) for tensor in tensors]
    return None if any(source is None for source in sources) else StackedSlices(tuple(sources))


def checkpoint_paths(location: str, component: str) -> list[str]:
    """The component's safetensors files (every shard of a sharded checkpoint), found as from_pretrained
    finds them (a local folder, or the hub cache, downloading what is missing). OSError: there are none."""
    from diffusers.models.model_loading_utils import _fetch_index_file
    from diffusers.utils.hub_utils import _get_checkpoint_shard_files, _get_model_file

    local = os.path.isdir(location)
    index = _fetch_index_file(local, location, component, True, None, None, False, None, False, None, None, None, None)
    if index is not None and index.is_file():
        return list(_get_checkpoint_shard_files(location, index, subfolder=component)[0])
    return [_get_model_file(location, weights_name=SAFETENSORS_NAME, subfolder=component)]


def _empty_module(cls, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The module as from_pretrained constructs it before loading: parameters on the meta device, buffers
    computed on the host, under `dtype` as the default dtype."""
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    previous = cls._set_default_torch_dtype(dtype)
    try:
        with no_init_weights(), init_empty_weights():
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def _load_dtype(cls, name: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """What from_pretrained converts a stored tensor to: floating tensors to `dtype`, or to float32 where a part
    of the name is one of the class's `_keep_in_fp32_modules`; other tensors stay as stored."""
    if not stored.is_floating_point:
        return stored
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    return torch.float32 if keep & set(name.split(".")) else dtype


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_direct(source, component: str, dtype: torch.dtype) -> torch.nn.Module | None:
    """The component with its parameters on the meta device, each carrying its `file_source`, and its buffers
    as from_pretrained loads them; None (logged with the reason) where from_pretrained must load it."""
    cls = source.component_class(component)
    try:
        files = CheckpointFiles(checkpoint_paths(source.location, component))
    except OSError as error:
        log(f"{component}: read on the host by from_pretrained ({error})")
        return None
    module = _empty_module(cls, source.load_config(component), dtype)
    entries = files.entries()
    why = _mismatch(module, entries)
    if why is not None:
        log(f"{component}: read on the host by from_pretrained ({why})")
        return None
    parameters = dict(module.named_parameters())
    for name, (path, _, stored) in entries.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        target = _load_dtype(cls, name, _SAFETENSORS_DTYPES[stored], dtype)
        slices = FileSlices(files, path, name, target)
        if name in parameters:
            parameter = torch.nn.Parameter(torch.empty(parameters[name].shape, dtype=target, device="meta"))
            parameter.file_source = slices
            owner._parameters[leaf] = parameter
        else:  # a buffer the checkpoint holds: small, read now
            owner._buffers[leaf] = slices.read(())
    module.register_to_config(_name_or_path=source.location)
    return module.eval()


def _mismatch(module: torch.nn.Module, entries: dict) -> str | None:
    """Why the checkpoint's tensors cannot be loaded by name into the module exactly (None: they can)."""
    if len(list(module.named_parameters(remove_duplicate=False))) != len(list(module.named_parameters())):
        return "the module ties weights"
    expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    expected_floating = {name: tensor.is_floating_point() for name, tensor in module.state_dict().items()}
    missing, unexpected = expected.keys() - entries.keys(), entries.keys() - expected.keys()
    if missing or unexpected:
        return f"{len(missing)} tensor(s) missing from the checkpoint, {len(unexpected)} not in the module"
    for name, (_, shape, stored) in entries.items():
        if tuple(shape) != expected[name]:
            return f"{name} is {tuple(shape)} in the checkpoint, {expected[name]} in the module"
        if stored not in _SAFETENSORS_DTYPES:
            return f"{name} is stored as {stored}"
        if expected_floating[name] and not _SAFETENSORS_DTYPES[stored].is_floating_point:
            raise UserError(
                f"{name} is stored as {stored} in the checkpoint, where the module holds floating-point values; "
                "the checkpoint is damaged or of another model"
            )
    return None
