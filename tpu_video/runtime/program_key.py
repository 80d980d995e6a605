"""What a compiled program depends on, as named parts with one digest each (tpu_video/runtime/executables.py keys
saved executables by them, and names the part that differs when a saved one does not match).

Besides the installed libraries, the devices and the inputs' shapes, a program holds every value its
Python read while being traced: a guidance scale kept as an attribute, an attention plan in a closure,
a `do_cfg` branch. Rather than trusting each module to list those, `describe` walks everything the
module reaches (attributes, submodules, hooks, attention processors, the closures and bound objects of
functions it holds, the attention op installed in the torchax environment) down to plain values.
Parameters and buffers are the program's arguments, so only their names, shapes and dtypes count;
any other tensor it reaches would be baked in, so its values count. What `describe` cannot reduce to
plain values makes the program unsaveable (ProgramKeyError), never a wrong hit.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import json
import os
import types
from pathlib import Path, PurePath

import jax
import numpy as np
import torch

from tpu_video.runtime.interface import library_versions

KEY_FORMAT = 3  # bump when what a key covers changes
LIBRARIES = ("jax", "jaxlib", "libtpu", "jax-cuda13-plugin", "jax-cuda13-pjrt", "torch", "torchax", "diffusers")
LIBRARIES += ("transformers",)
# The compiler's own settings. Which platform and devices is the `devices` part's: a plan on a CPU host (which
# sets TPU_ACCELERATOR_TYPE only to quiet libtpu) keys its TPU programs as the TPU VM's run does.
ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# JAX settings that change what a trace lowers to (read through jax.config, so context managers count).
JAX_SETTINGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl", "jax_numpy_rank_promotion")


# Config entries (and a transformers model's own `name_or_path`) that say where a model came from, not what it
# computes: another checkpoint of the same configuration in another folder reuses its programs (its weights
# are arguments).
BOOKKEEPING = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "_diffusers_version", "transformers_version"})


class ProgramKeyError(ValueError):
    """A program reaches something `describe` cannot reduce to plain values."""


# The product's modules (pyproject.toml ships these; tests/test_executables.py keeps the lists equal).
PRODUCT = (
    "tpu_video",
    "sharding",
    "splash_attention",
    "stage1_text_encoder",
    "stage2_transformer",
    "stage3_vae_decoder",
    "utils",
)


@functools.cache
def source_digest() -> str:
    """One digest of this tool's Python source (every module it ships): a fix to a forward, a kernel
    wrapper or a workaround changes no version string."""
    sha = hashlib.sha256()
    for name in PRODUCT:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ProgramKeyError(f"cannot find this tool's module {name}")
        root = Path(spec.origin)
        files = sorted(root.parent.rglob("*.py")) if root.name == "__init__.py" else [root]
        for path in files:
            sha.update(f"{name}/{path.relative_to(root.parent)}\0".encode())
            sha.update(path.read_bytes())
    return sha.hexdigest()


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def environment_parts(mesh, process: int | None = None) -> dict:
    """The parts every program of this process shares: libraries, settings, devices, source. The devices are
    the mesh's (abstract TPU devices in a plan); `process` is the one running it (default: this process)."""
    devices = mesh.devices.flatten()
    return {
        "format": KEY_FORMAT,
        "libraries": library_versions(*LIBRARIES),
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
        "jax_settings": {name: str(getattr(jax.config, name)) for name in JAX_SETTINGS},
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "processes": len({device.process_index for device in devices}),
            "process": jax.process_index() if process is None else process,  # each process keeps its own
            "mesh": describe_mesh(mesh),
        },
        "source": source_digest(),
    }


def describe_mesh(mesh) -> dict:
    return {"axes": dict(mesh.shape), "devices": [int(d.id) for d in mesh.devices.flatten()]}


def describe_array(array) -> list:
    """A baked-in array: its shape, dtype and a digest of its values."""
    if isinstance(array, torch.Tensor):
        data = array.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ["constant", list(array.shape), str(array.dtype), hashlib.sha256(data).hexdigest()]
    array = np.asarray(array)
    return ["constant", list(array.shape), str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest()]


def argument(tensor: torch.Tensor) -> list:
    """A tensor passed as a program argument: its shape and its dtype as placed (JAX holds int64 as int32),
    so a run's placed weights and a plan's meta ones describe alike."""
    from tpu_video.runtime.placement import JAX_DTYPES

    dtype = JAX_DTYPES.get(tensor.dtype)
    return ["argument", list(tensor.shape), np.dtype(dtype).name if dtype is not None else str(tensor.dtype)]


class Describer:
    """Reduces objects to JSON-able descriptions; `arguments` are the ids of the tensors passed as
    program arguments (described by shape and dtype only). An object met again is a reference."""

    def __init__(self, arguments: set[int]) -> None:
        self.arguments = arguments
        self.seen: dict[int, int] = {}
        self.keep: list = []  # objects described so far stay alive, so their ids stay unique

    def __call__(self, obj, path: str = "module"):
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return repr(obj)
        if isinstance(obj, PurePath):
            return ["path", str(obj)]
        if isinstance(obj, (enum.Enum, torch.dtype, torch.device, torch.Size, np.dtype, type)):
            return [type(obj).__qualname__, f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj)}"]
        if id(obj) in self.seen:
            return ["ref", self.seen[id(obj)]]
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        return self._compound(obj, path)

    def _compound(self, obj, path: str):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.arguments:
                return argument(obj)
            value = obj.jax() if hasattr(obj, "jax") else obj
            if isinstance(value, jax.core.Tracer):  # left on the module by an earlier trace: unusable here
                return ["tracer", list(value.shape), str(value.dtype)]
            return describe_array(value)
        if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
            return describe_array(obj)
        if isinstance(obj, jax.sharding.Mesh):
            return ["mesh", describe_mesh(obj)]
        if isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if k not in BOOKKEEPING]
            return ["dict", [[self(k, path), self(v, f"{path}[{k!r}]")] for k, v in items]]
        if isinstance(obj, (list, tuple)):
            return [type(obj).__name__, [self(v, f"{path}[{i}]") for i, v in enumerate(obj)]]
        if isinstance(obj, (set, frozenset)):
            return ["set", sorted(json.dumps(self(v, path), default=str) for v in obj)]
        if hasattr(obj, "program_fingerprint"):  # objects that say what of them a program reads
            # named by the method that says it: a subclass that keeps it (planning's runtime) keys as its base
            said_by = qualified(type(obj).program_fingerprint)
            return [said_by, self(obj.program_fingerprint(), f"{path}.program_fingerprint()")]
        if isinstance(obj, functools.partial):
            return ["partial", self(obj.func, path), self(obj.args, path), self(obj.keywords, path)]
        if isinstance(obj, types.MethodType):
            return ["method", qualified(obj.__func__), self(obj.__self__, f"{path}.__self__")]
        if isinstance(obj, types.FunctionType):
            cells = [_contents(cell) for cell in obj.__closure__ or ()]
            return [
                "function",
                qualified(obj),
                code_digest(obj.__code__),  # two lambdas of one scope share a name
                self(dict(zip(obj.__code__.co_freevars, cells, strict=True)), f"{path}.<closure>"),
                self(obj.__defaults__, path),
                self(obj.__kwdefaults__, path),
            ]
        if isinstance(obj, (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodDescriptorType)):
            return ["builtin", f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"]
        if isinstance(obj, torch.nn.Module):
            return self._module(obj, path)
        if dataclasses.is_dataclass(obj):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return [qualified(type(obj)), self(fields, path)]
        if hasattr(obj, "__dict__") and not isinstance(obj, types.ModuleType):
            return [qualified(type(obj)), self(vars(obj), path)]
        raise ProgramKeyError(f"{path} is a {qualified(type(obj))}, which a saved program cannot be keyed by")

    def _module(self, module: torch.nn.Module, path: str):
        attributes = {}
        for name, value in vars(module).items():
            if name in BOOKKEEPING:
                continue
            if name in ("_parameters", "_buffers"):
                value = {k: None if v is None else argument(v) for k, v in value.items()}
                attributes[name] = value
            elif name.startswith("_") and "hooks" in name and isinstance(value, dict):
                # keyed by a process-wide handle counter: only the hooks, in their order, count
                attributes[name] = self(list(value.values()), f"{path}.{name}")
            else:
                attributes[name] = self(value, f"{path}.{name}")
        return [qualified(type(module)), attributes]


def code_digest(code: types.CodeType) -> str:
    """A function's bytecode, names and constants (nested functions' included)."""
    sha = hashlib.sha256(code.co_code)
    sha.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            text = code_digest(constant)
        elif isinstance(constant, frozenset):  # `x in {"a", "b"}`: its order follows the per-process str hash
            text = repr(sorted(map(repr, constant)))
        else:
            text = repr(constant)
        sha.update(text.encode())
    return sha.hexdigest()


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return ["empty cell"]


def qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def program_parts(module, method: str, state, inputs, env_parts: dict, attention) -> dict[str, str]:
    """The digest of each named part of one program's key: the shared environment parts, the attention op
    the torchax environment holds, the module (everything it reaches), the method and the inputs' signature."""
    arguments = {id(tensor) for tensor in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, torch.Tensor))}
    arguments |= {id(tensor) for tensor in module.parameters()} | {id(tensor) for tensor in module.buffers()}
    describe = Describer(arguments)
    parts = {
        **env_parts,
        "attention": describe(attention, "attention"),
        "module": describe(module),
        "method": method,
        "arguments": describe_signature(state),
        "inputs": describe_signature(inputs),
    }
    return {part: digest(value) for part, value in parts.items()}


def describe_signature(tree) -> list:
    """Each input's structure, shape, dtype and layout (Python scalars by type, as jax.jit traces them). A
    placed array and its abstract twin (a plan's jax.ShapeDtypeStruct) describe alike."""
    leaves, structure = jax.tree.flatten(tree)
    return [
        str(structure),
        [
            [list(leaf.shape), str(leaf.dtype), layout(leaf.sharding, tuple(leaf.shape))]
            if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
            else qualified(type(leaf))
            for leaf in leaves
        ],
    ]


@functools.lru_cache(maxsize=4096)
def layout(sharding, shape: tuple) -> tuple:
    """Which slice of an array of `shape` each device holds. Equivalent shardings give one layout (P() and
    P("dp", None) on a one-device mesh; a program's output sharding and the placed one it equals), as a
    compiled executable accepts either: one program, not two."""
    slices = sharding.devices_indices_map(shape).items()
    return tuple(sorted((int(device.id), tuple((s.start, s.stop, s.step) for s in index)) for device, index in slices))
