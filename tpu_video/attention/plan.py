"""The attention plan of one stage-2 run: mesh (and why), tp mode, backend, sequence-parallel scheme and
the Splash kernel's tiles and options, resolved once from the flags, the platform and the model into one
frozen value. It is recorded as built (the `stage2` section, a plan's report) and passed down: the
kernels and the SDPA override (tpu_video/runtime/sdpa.py) read it and never read flags.

JAX-free, so `--plan` and every run build it through the same function (`build_plan`) on any host.
Raises ValueError worded with the flag names (the stages add the `error:`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpu_video.attention.sp_modes import sp_mode_choice

LANE = 128  # TPU lane width: Splash tiles are multiples of it
BACKENDS = ("auto", "splash", "xla", "cudnn")
TILE_NAMES = ("block_q", "block_kv", "block_kv_compute")
# Flags that only the Splash kernel reads: given under another backend they would do nothing.
SPLASH_ONLY_FLAGS = (*TILE_NAMES, "local_window", "k_smoothing")
FUSED_DTYPES = (torch.bfloat16, torch.float16)  # what cuDNN's fused attention takes


@dataclass(frozen=True)
class SplashConfig:
    """The Splash kernel's tiles (upper bounds: a short sequence uses one tile of its own padded length) and
    options.

    `local_window` w lets query i see keys i-w..i+w only (self-attention). `k_smoothing` subtracts the
    mean of the valid keys from every key: each query's scores shift by one constant, which softmax
    ignores, so the result is unchanged in exact arithmetic while scores are centred (better bf16 range).
    `interpret`: Pallas interpret mode (off TPU).
    """

    block_q: int = 3328
    block_kv: int = 2816
    block_kv_compute: int = 256
    interpret: bool = False
    local_window: int | None = None
    k_smoothing: bool = False

    def __post_init__(self) -> None:
        for name in TILE_NAMES:
            value = getattr(self, name)
            if value <= 0 or value % LANE:
                raise ValueError(f"{name} {value} must be a positive multiple of {LANE}")
        if self.block_kv % self.block_kv_compute:
            raise ValueError(f"block_kv_compute {self.block_kv_compute} must divide block_kv {self.block_kv}")
        if self.local_window is not None and self.local_window < 0:
            raise ValueError(f"local_window {self.local_window} must be >= 0")


@dataclass(frozen=True)
class AttentionFlags:
    """What the user asked for (None: not given), as the stage-2 flags spell it."""

    attention: str = "auto"
    sp_mode: str = "auto"
    tp_mode: str = "megatron"
    dp: int | None = None
    sp: int | None = None
    tp: int | None = None
    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None
    local_window: int | None = None
    k_smoothing: bool = False

    def splash_only_given(self) -> list[str]:
        """The Splash-only flags the user gave (k_smoothing counts when on)."""
        return [name for name in SPLASH_ONLY_FLAGS if getattr(self, name) not in (None, False)]


@dataclass(frozen=True)
class AttentionPlan:
    """One run's attention, resolved: `backend` is never "auto"; `splash` is set for the Splash backend
    only; `sequence_parallel` is the scheme for the model's heads on the mesh ("none" without a split
    sequence). The rest says how they were chosen, for the record (build_plan fills in every field)."""

    backend: str
    splash: SplashConfig | None = None
    sequence_parallel: str = "none"
    backend_why: str = "as given"
    sp_mode: str = "auto"  # as asked (attention.sp_modes.SP_MODES)
    sequence_parallel_why: str = ""
    tp_mode: str = "megatron"
    mesh: Any = None  # the runtime.mesh.MeshChoice it was resolved on (that module imports this package)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS[1:]:
            raise ValueError(f"a plan's backend is one of {BACKENDS[1:]}, not {self.backend!r}")
        if (self.splash is not None) != (self.backend == "splash"):
            raise ValueError("a plan has Splash tiles exactly when its backend is splash")

    def record(self) -> dict:
        """The plan as the `stage2` section records it (keys tests and users read: attention, attention_choice,
        mesh_choice, sequence_parallel, tp_mode; `splash` where it runs)."""
        splash = {"splash": {**dataclasses.asdict(self.splash), "sp_mode": self.sp_mode}} if self.splash else {}
        return {
            "tp_mode": self.tp_mode,
            "attention": self.backend,
            "attention_choice": self.backend_why,
            "mesh_choice": self.mesh.record() if self.mesh else None,
            "sequence_parallel": {"mode": self.sequence_parallel, "why": self.sequence_parallel_why},
            **splash,
        }

    def program_fingerprint(self) -> dict:
        """What a program reads of the plan (runtime.sdpa.make_sdpa), for saved executables' keys
        (tpu_video/runtime/program_key.py): the reasons and the mesh's memory estimate are for the record, and a plan
        (`--plan`, built with the nominal HBM) keys its programs as the TPU's run (the measured HBM) does."""
        return {"backend": self.backend, "splash": self.splash, "sequence_parallel": self.sequence_parallel}


def fixed_plan(
    backend: str,
    splash: SplashConfig | None = None,
    *,
    mesh_shape: dict[str, int] | None = None,
    heads: int = 1,
    sp_mode: str = "auto",
    tp_mode: str = "megatron",
) -> AttentionPlan:
    """A plan for one backend on a mesh of `mesh_shape` (None: one device), without a run's flags: per-block
    HLO counts, benchmarks and tests. The scheme is resolved for `heads` as build_plan resolves it."""
    shape = mesh_shape or {"dp": 1, "sp": 1, "tp": 1}
    scheme, why = sp_mode_choice(sp_mode, shape, heads, splash is not None and splash.local_window is not None)
    return AttentionPlan(backend, splash, scheme, sp_mode=sp_mode, sequence_parallel_why=why, tp_mode=tp_mode)


def resolve_backend(requested: str, dtype: torch.dtype, platform: str) -> tuple[str, str]:
    """The backend to run and why: `auto` is Splash on TPU, cuDNN fused attention on a GPU (XLA in fp32,
    which cuDNN does not take), plain XLA attention elsewhere. `cudnn` needs a GPU and bf16/fp16."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {BACKENDS}")
    fused_ok = dtype in FUSED_DTYPES
    if requested == "cudnn" and platform != "gpu":
        raise ValueError(f"attention cudnn needs an NVIDIA GPU; JAX's devices here are {platform}")
    if requested == "cudnn" and not fused_ok:
        raise ValueError(f"attention cudnn takes bf16 or fp16, not {dtype}; use xla for fp32")
    if requested != "auto":
        return requested, "as given"
    if platform == "tpu":
        return "splash", "auto: TPU"
    if platform == "gpu" and fused_ok:
        return "cudnn", "auto: GPU"
    if platform == "gpu":
        return "xla", f"auto: GPU, but cuDNN's fused attention takes bf16/fp16, not {dtype}: XLA attention"
    return "xla", f"auto: {platform}"


def splash_tiles(defaults: dict[str, int], cap: tuple[int, int, int] | None) -> tuple[dict[str, int], str | None]:
    """A family's default tiles, replaced by a TPU generation's measured set where its scoped VMEM cannot
    hold them (planning.tpus.Generation.splash_tile_cap), and a line saying so (None: kept)."""
    blocks = {name: defaults[name] for name in TILE_NAMES}
    if cap is not None and any(blocks[name] > limit for name, limit in zip(TILE_NAMES, cap, strict=True)):
        capped = dict(zip(TILE_NAMES, cap, strict=True))  # the measured set, not a mix of both
        return capped, f"Splash tiles {blocks} replaced by {capped}: larger ones exceed the generation's scoped VMEM"
    return blocks, None


def _refuse_splash_flags(flags: AttentionFlags, backend: str, why: str) -> None:
    given = flags.splash_only_given()
    if given:
        name = given[0]
        value = "" if name == "k_smoothing" else f" {getattr(flags, name)}"
        raise ValueError(
            f"--{name}{value} acts only on the Splash kernel, but attention here is {backend} ({why}): "
            "add --attention splash (Pallas interpret mode off a TPU), or drop the flag"
        )


def build_plan(
    flags: AttentionFlags,
    *,
    platform: str,
    dtype: torch.dtype,
    heads: int,
    tile_defaults: dict[str, int],
    tile_cap: tuple[int, int, int] | None,
    choose_mesh: Callable[..., Any],
    log: Callable[[str], None] = lambda line: None,
) -> AttentionPlan:
    """The run's plan. `choose_mesh(dp, sp, tp, sequence_split=...)` is the default-mesh choice
    (runtime.mesh.default_mesh) for the axes given (None: chosen), where sequence_split False keeps a
    default sp at 1; `tile_cap`: the TPU generation's (None elsewhere).

    Order: flag values, then whether the Splash-only flags can act under the backend asked for (before the
    platform, so on any host that error is the flag's), then the backend for the platform, the mesh, the
    sequence-parallel scheme. Every ValueError is worded with the stage-2 flags it is about."""
    blocks, capped = splash_tiles(tile_defaults, tile_cap)
    blocks.update({name: getattr(flags, name) for name in TILE_NAMES if getattr(flags, name) is not None})
    with _flag_words():
        splash = SplashConfig(
            **blocks, interpret=platform != "tpu", local_window=flags.local_window, k_smoothing=flags.k_smoothing
        )
    if flags.attention in ("xla", "cudnn"):
        _refuse_splash_flags(flags, flags.attention, "as given")
    with _flag_words():
        backend, backend_why = resolve_backend(flags.attention, dtype, platform)
    mesh = _cudnn_mesh(flags, choose_mesh) if backend == "cudnn" else None
    if backend == "cudnn" and mesh is None:  # auto: cuDNN cannot run on the mesh these devices need
        backend, backend_why = "xla", f"{backend_why}, but the mesh splits the sequence, which cuDNN does not run"
    if mesh is None:
        with _flag_words(mesh=True):
            mesh = choose_mesh(flags.dp, flags.sp, flags.tp, sequence_split=True)
    if backend != "splash":
        _refuse_splash_flags(flags, backend, backend_why)
    elif capped and not any(getattr(flags, name) for name in TILE_NAMES):
        log(capped)
    with _flag_words():
        window = flags.local_window is not None
        scheme, scheme_why = sp_mode_choice(flags.sp_mode, mesh.shape.as_dict(), heads, window)
    return AttentionPlan(
        mesh=mesh,
        tp_mode=flags.tp_mode,
        backend=backend,
        backend_why=backend_why,
        sp_mode=flags.sp_mode,
        sequence_parallel=scheme,
        sequence_parallel_why=scheme_why,
        splash=splash if backend == "splash" else None,
    )


@contextlib.contextmanager
def _flag_words(mesh: bool = False):
    """Re-raise the libraries' ValueErrors in the flags' words: a value's name gets its `--`; in mesh
    errors every axis does (`dp 2 x sp 1` -> `--dp 2 --sp 1`)."""
    try:
        yield
    except ValueError as err:
        raise ValueError(_mesh_flags(str(err)) if mesh else f"--{err}") from None


def _mesh_flags(text: str) -> str:
    return re.sub(r"\b(dp|sp|tp)\b", r"--\1", text).replace(" x --", " --")


def _cudnn_mesh(flags: AttentionFlags, choose_mesh) -> Any:
    """cuDNN's mesh: sp 1 by default, since cuDNN does not run under the sequence-parallel schemes yet. A
    given sp > 1, or devices that no mesh with sp 1 fits, is an error under `--attention cudnn` (naming a
    mesh that works) and None under auto (the caller then runs XLA attention)."""
    explicit = flags.attention == "cudnn"
    if flags.sp and flags.sp > 1:
        if not explicit:
            return None
        try:
            works = "a mesh that works: " + _mesh_flags(str(choose_mesh(None, 1, None, sequence_split=False).shape))
        except ValueError:
            works = "no mesh of these devices keeps sp 1"
        raise ValueError(
            f"--sp {flags.sp}: cuDNN attention does not run under sequence parallelism yet; {works}, or --attention xla"
        )
    try:
        with _flag_words(mesh=True):
            return choose_mesh(flags.dp, flags.sp, flags.tp, sequence_split=False)
    except ValueError as err:
        if not explicit:
            return None
        raise ValueError(
            f"{err}; cuDNN attention needs sp 1 (no sequence parallelism yet): try --attention xla"
        ) from None
