"""JAX (0.10.2 here, 0.11.2 on the GPU host): what we need that it has no public or working path for.

- `keep_cpu_backend`: host callbacks need a CPU device, which `JAX_PLATFORMS=cuda` removes.
- `coordination_client`: JAX has no public key-value API for its coordination service.
- `without_compilation_cache`: an executable the persistent compilation cache returned (on CPU) saves
  into bytes that load in a new process but fail when run.
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
