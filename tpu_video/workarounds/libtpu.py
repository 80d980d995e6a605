"""libtpu on a host without TPU chips, where it only compiles (`--plan`, the planning tests).

Seen with libtpu 0.0.42.1 (from `jax[tpu]==0.10.2`): noise on stderr and a process-wide lock file. No
canary: these are libtpu's documented environment variables, not a bug that a release will fix; delete
`libtpu_off_tpu` only if libtpu stops reading them.
"""

from __future__ import annotations


def libtpu_off_tpu() -> None:
    """Make libtpu behave on hosts without TPU chips, where it only compiles (--plan).

    libtpu (the tpu extra; `make test` installs it for --plan) prints several lines to stderr when JAX
    starts its backends, or when --plan asks it for a topology ("could not determine TPU accelerator
    type", worker hostnames, "Logging before InitGoogle"); with TPU_ACCELERATOR_TYPE and
    TPU_WORKER_HOSTNAMES set it stays quiet and JAX still runs on the CPU. It also takes a lock file
    that makes a second process fail ("libtpu multi-process lockfile") while one holds it; with no
    chips to share, ALLOW_MULTIPLE_LIBTPU_LOAD lets plans run side by side. TPU VMs expose their chips
    as /dev/accel* or /dev/vfio: there nothing is changed, and a value the user set is never replaced.
    """
    import os
    from pathlib import Path

    if any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists():
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-8")  # any valid type; only read to stay quiet
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
