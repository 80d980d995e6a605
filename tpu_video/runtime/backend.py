"""Which runtime stages 1 and 3 run on: `--backend torch` on a torch `--device`, or `--backend torchax` on
every JAX device; stage 3's `--backend auto` chooses. Importing this module needs neither torch nor JAX (the
stages' parsers read its choices): each is probed or imported only when a choice needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_video.cli import UserError

if TYPE_CHECKING:  # annotations only
    from tpu_video.runtime.interface import Runtime

BACKENDS = ("torch", "torchax")
STAGE3_BACKENDS = ("auto", *BACKENDS)


def check_backend_flags(backend: str, device: str | None, executables: str = "auto") -> None:
    """Refuse `--backend`/`--device`/`--executables` combinations up front, before any file is read, and
    `--backend torchax` on a host without JAX before the models' libraries load (seconds, not a traceback)."""
    if backend not in STAGE3_BACKENDS:
        raise UserError(f"--backend {backend!r} is not one of {', '.join(STAGE3_BACKENDS)}")
    if backend == "torchax" and device is not None:  # it would be silently ignored: every JAX device is used
        raise UserError(f"--device applies to --backend torch; --backend {backend} uses every JAX device")
    if backend == "torch" and executables not in ("auto", "off"):  # a folder named for nothing to save or load
        raise UserError(f"--executables {executables} holds torchax programs; --backend torch compiles none")
    if device is not None:
        check_torch_device(device)
    if backend == "torchax":
        torchax_runtime_module()


def check_torch_device(name: str) -> None:
    """`--device` must name a torch device this host has (cpu, cuda, cuda:N, mps)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:N or mps)") from None
    probes = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if device.type not in probes:
        raise UserError(f"--device {name!r}: stages run on cpu, cuda or mps")
    if not probes[device.type]():
        found = "has no MPS device"
        if device.type == "cuda":
            count = torch.cuda.device_count()
            found = "is built without CUDA" if torch.version.cuda is None else f"sees {count} CUDA GPU(s)"
        raise UserError(f"--device {name}: this torch {found}; use --device cpu (or --backend torchax)")


def jax_platform() -> str | None:
    """The platform of JAX's default devices ("tpu", "gpu", "cpu"), or None when JAX cannot be imported.
    Imports JAX: called only once torch has no GPU."""
    from tpu_video.workarounds.libtpu import libtpu_off_tpu

    libtpu_off_tpu()  # as workarounds.torchax does: off a TPU VM, libtpu must not try to claim one
    try:
        import jax
    except ImportError:
        return None
    return jax.devices()[0].platform


def choose_backend(backend: str, device: str | None, cuda=None, platform=jax_platform) -> tuple[str, str | None, str]:
    """Stage 3's `--backend auto`: torch on CUDA when torch sees a GPU (JAX never imported), else torchax
    when JAX sees a TPU or GPU, else torch on the CPU. Returns (backend, device, the reason in words);
    an explicit backend is kept. `cuda` and `platform` are the probes (replaced in tests)."""
    if backend != "auto":
        return backend, device, "as given"
    if device is not None:
        return "torch", device, f"--device {device} given: torch"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available
    if cuda():
        return "torch", "cuda", "torch sees a CUDA GPU: torch on cuda"
    found = platform()
    if found in ("tpu", "gpu"):
        return "torchax", None, f"torch sees no GPU, JAX sees a {found.upper()}: torchax on every JAX device"
    jax_says = "JAX is not installed" if found is None else f"JAX sees only {found}"
    return "torch", "cpu", f"torch sees no GPU and {jax_says}: torch on cpu"


def open_runtime(
    backend: str, device: str | None, axis: str, compile_cache: bool = True, executables: str = "auto"
) -> Runtime:
    """Stages 1 and 3: `--backend torch` on `--device` (default cpu), or `--backend torchax` with every JAX
    device on mesh axis `axis` (and `--executables`). A host without JAX gets one error line naming the
    install."""
    check_backend_flags(backend, device)
    if backend == "torch":
        from tpu_video.runtime.interface import TorchRuntime

        return TorchRuntime(device or "cpu")
    from tpu_video.runtime import torchax_runtime  # importable: check_backend_flags asked torchax_runtime_module

    return torchax_runtime.TorchaxRuntime.on_all_devices(axis, compile_cache=compile_cache, executables=executables)


def torchax_runtime_module():
    """tpu_video.runtime.torchax_runtime (imports JAX and torchax); a host without them gets one error line
    naming the install."""
    try:
        from tpu_video.runtime import torchax_runtime
    except ImportError as err:
        raise UserError(
            f"--backend torchax needs JAX and torchax ({err}); install them with "
            "pip install -e '.[tpu]' (or .[gpu], .[cpu]), or use --backend torch"
        ) from None
    return torchax_runtime
