"""JAX (0.10.2 here, 0.11.2 on the GPU host): what we need that it has no public or working path for.

- `keep_cpu_backend`: host callbacks need a CPU device, which `JAX_PLATFORMS=cuda` removes.
- `coordination_client`: JAX has no public key-value API for its coordination service.
- Multi-host stage 2 turns JAX's preemption service off (runtime/distributed.py, `Processes.start`):
  it swallows SIGTERM in C++ and only logs it; tests/test_multihost.py shows a SIGTERM still stops a run.
JAX is imported inside the functions, so importing this module needs no JAX.
"""

from __future__ import annotations


def with_cpu_platform(platforms: str | None) -> str | None:
    """A JAX_PLATFORMS value with `cpu` appended when it names only accelerators ("cuda" -> "cuda,cpu")."""
    if not platforms or "cpu" in platforms.split(","):
        return platforms
    return f"{platforms},cpu"


def keep_cpu_backend() -> None:
    """Keep JAX's CPU backend beside the accelerator, before JAX starts its backends.

    The in-graph mask checks (attention.cudnn, attention.masks) raise through `jax.debug.callback`,
    and JAX runs every host callback on a CPU device: with JAX_PLATFORMS=cuda (or tpu) alone a step fails
    with "jax.debug.callback failed to find a local CPU device" (seen on an H100 with JAX 0.11.2). The CPU
    backend costs nothing there, and JAX still picks the accelerator as the default backend.
    """
    import jax

    platforms = jax.config.jax_platforms
    wanted = with_cpu_platform(platforms)
    if wanted != platforms:
        jax.config.update("jax_platforms", wanted)


def coordination_client():
    """The running process's client of JAX's coordination service (key-value store and barriers).

    Private: `jax._src.distributed.global_state`. tests/test_multihost.py runs through it; if a JAX release
    moves it or adds a public key-value API, this one function changes."""
    from jax._src import distributed

    return distributed.global_state.client
