"""JAX (0.10.2 here, 0.11.2 on the GPU host): what we need that it has no public or working path for.

- `keep_cpu_backend`: host callbacks need a CPU device, which `JAX_PLATFORMS=cuda` removes.
- `coordination_client`: JAX has no public key-value API for its coordination service.
- `without_compilation_cache`: an executable the persistent compilation cache returned (on CPU) saves
  into bytes that load in a new process but fail when run.
- `lapack_ready`: a saved CPU program that calls LAPACK (a QR: Wan Animate's motion encoder) crashes when
  loaded and run in a new process, unless jaxlib's LAPACK kernels were set up first.
- Multi-host stage 2 turns JAX's preemption service off (tpu_video/runtime/distributed.py, `Processes.start`):
  it swallows SIGTERM in C++ and only logs it; tests/test_multihost.py shows a SIGTERM still stops a run.
JAX is imported inside the functions, so importing this module needs no JAX.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def with_cpu_platform(platforms: str | None) -> str | None:
    """A JAX_PLATFORMS value with `cpu` appended when it names only accelerators ("cuda" -> "cuda,cpu")."""
    if not platforms or "cpu" in platforms.split(","):
        return platforms
    return f"{platforms},cpu"


def keep_cpu_backend() -> None:
    """Keep JAX's CPU backend beside the accelerator, before JAX starts its backends.

    A check traced outside runtime.programs (tpu_video.program_checks' fallback) raises through
    `jax.debug.callback`, and JAX runs every host callback on a CPU device: with JAX_PLATFORMS=cuda (or
    tpu) alone a step fails with "jax.debug.callback failed to find a local CPU device" (seen on an H100
    with JAX 0.11.2). The CPU backend costs nothing there, and JAX still picks the accelerator as the default backend.
    """
    import jax

    platforms = jax.config.jax_platforms
    wanted = with_cpu_platform(platforms)
    if wanted != platforms:
        jax.config.update("jax_platforms", wanted)


@contextlib.contextmanager
def without_compilation_cache() -> Iterator[None]:
    """Compile inside the block without JAX's persistent compilation cache (neither read nor written).

    JAX 0.10.2 on CPU: serialize_executable of an executable that came out of the persistent cache gives
    bytes that deserialize in a new process and then fail when run, with "NOT_FOUND: Function
    convert_convert_fusion not found (type id: 1)" (tests/test_upstream_bugs.py). Programs bound for the
    executable store (tpu_video/runtime/executables.py) are therefore compiled fresh; the store then does the
    cache's work for them. JAX settles whether the cache is used at the first compile: reset_cache makes it
    look again, on entry and on exit."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def coordination_client():
    """The running process's client of JAX's coordination service (key-value store and barriers).

    Private: `jax._src.distributed.global_state`. tests/test_multihost.py runs through it; if a JAX release
    moves it or adds a public key-value API, this one function changes."""
    from jax._src import distributed

    return distributed.global_state.client


def lapack_ready() -> None:
    """Set up jaxlib's CPU LAPACK kernels, as lowering a linear-algebra op does, before a saved program runs.

    JAX 0.10.2: jaxlib fills in its LAPACK function table (from scipy) only when a program using it is lowered
    (jax._src.lax.linalg.initialize_lapack). A program loaded by the executable store in a new process skips
    the lowering, and its first call of a LAPACK kernel crashes the process (SIGSEGV in
    jax::QrFactorizationKernel, lapack_sgeqrf_ffi: Wan Animate's motion encoder runs torch.linalg.qr).
    tests/test_upstream_bugs.py checks the crash still happens without this; delete this and its call in
    tpu_video/runtime/executables.py once that canary fails."""
    from jax._src.lax.linalg import initialize_lapack

    initialize_lapack()
