"""Stage 2 on several hosts: JAX's multi-controller runtime (one process per host, each owning its local
devices, one global mesh) and the agreement the stage needs on top of JAX's collectives.

When it starts (`launch_settings`): with `--coordinator_address/--num_processes/--process_id` (or
JAX_COORDINATOR_ADDRESS with the other two flags) on any platform, and on its own on a Cloud TPU VM that
belongs to a multi-host slice (the TPU runtime lists more than one worker in TPU_PROCESS_ADDRESSES or
TPU_WORKER_HOSTNAMES; JAX's `jax.distributed.initialize()` then discovers the rest). Otherwise the stage
is one process and nothing here runs: `Processes()` is the single-process case, free of JAX.

No process acts on a decision alone. Before any weight loads, every process reports whether its inputs
were valid and all stop unless all were (`agree`); after every step they agree whether any was asked to
stop (SIGTERM on one host stops all at the same step, `any`); the checkpoint to resume from is process
0's, broadcast to the rest, so it works with a shared file system and with a copy per host alike
(`broadcast_bytes`). A process that raises tells the others at once; one that is killed or hangs stops
renewing its heartbeat key and the others exit after `peer_timeout` seconds. Both end with an `error:`
line in every process, never JAX's 300 s initialization wait or a hang in a collective.

The key-value store and barriers are JAX's coordination service client, reached through the private
`jax._src.distributed.global_state` (JAX has no public key-value API), through
workarounds.jax.coordination_client.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping

from tpu_video.cli import Stopped, UserError
from tpu_video.workarounds.jax import coordination_client

NAMESPACE = "tpu_video_stage2"
HEARTBEAT_SECONDS = 1.0
BARRIER_TIMEOUT_MS = 30 * 60 * 1000  # agreements wait for the slowest host (reading, hashing, compiling)
DEFAULT_PEER_TIMEOUT = 60  # seconds without a peer's heartbeat before this process gives up
PEER_FAILED_EXIT_STATUS = 2  # the `error:` status (cli.run_cli)


def launch_settings(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, object] | None:
    """Keyword arguments for jax.distributed.initialize, or None for a single process (see the module
    docstring for when). UserError where the flags are incomplete or inconsistent."""
    address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS")
    given = {"--coordinator_address": address, "--num_processes": num_processes, "--process_id": process_id}
    if any(value is not None for value in given.values()):
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise UserError(
                f"several processes need --coordinator_address HOST:PORT, --num_processes and --process_id; "
                f"missing {', '.join(missing)}"
            )
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--coordinator_address {address!r} must be HOST:PORT (process 0's host and a free port)")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UserError(f"--process_id {process_id} must be in 0..{num_processes - 1} (--num_processes)")
        if num_processes == 1:
            return None
        return {"coordinator_address": address, "num_processes": num_processes, "process_id": process_id}
    workers = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if len([host for host in workers.split(",") if host.strip()]) > 1:
        return {}  # a Cloud TPU slice of several hosts: JAX reads the rest from the TPU environment
    return None


class Processes:
    """This run's processes; the single-process default needs no JAX and agrees with itself at once."""

    def __init__(self, index: int = 0, count: int = 1, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
        self.index, self.count, self.peer_timeout = index, count, peer_timeout
        self._stop_watching = threading.Event()

    @property
    def is_main(self) -> bool:
        """Process 0: the only one that logs, writes files and reads the checkpoint."""
        return self.index == 0

    @classmethod
    def start(cls, settings: dict[str, object] | None, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> Processes:
        """Initialize JAX's distributed runtime with `settings` (launch_settings; None: one process) and
        start watching the peers. Call before anything else touches JAX devices."""
        if settings is None:
            return cls()
        import jax

        # CPU devices of several processes talk through gloo (TPUs and GPUs have their own collectives).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service catches SIGTERM in C++ and only logs it (jax 0.10.2), so a SIGTERM
        # before the loop's own handler would be swallowed; stops are agreed by DenoiseGuard instead.
        jax.config.update("jax_enable_preemption_service", False)
        # JAX's own heartbeat check aborts a process without an `error:` line; ours comes first.
        jax.distributed.initialize(**settings, heartbeat_timeout_seconds=int(peer_timeout) + 30)
        processes = cls(jax.process_index(), jax.process_count(), peer_timeout)
        threading.Thread(target=processes._watch, name="peer-watch", daemon=True).start()
        return processes

    # Agreement ------------------------------------------------------------------------------------

    def _exchange(self, phase: str, value: str) -> list[tuple[int, str]]:
        """Every process posts `value` for `phase`; after all have, each gets (process, value) for all."""
        client = coordination_client()
        client.key_value_set(f"{NAMESPACE}/{phase}/{self.index}", value)
        client.wait_at_barrier(f"{NAMESPACE}/{phase}", BARRIER_TIMEOUT_MS)
        reports = (
            (int(key.rsplit("/", 1)[1]), text) for key, text in client.key_value_dir_get(f"{NAMESPACE}/{phase}/")
        )
        return sorted(reports)

    def agree(self, phase: str, error: str | None) -> None:
        """Every process reports `error` (None: fine) for `phase`; all raise UserError unless all were fine."""
        if self.count == 1:
            if error is not None:
                raise UserError(error)
            return
        failed = [(index, message) for index, message in self._exchange(phase, error or "") if message]
        if failed:
            # Every process leaves with this error: a peer that exits first must not read as lost contact.
            self.finish()
            raise UserError("; ".join(f"process {index}: {message}" for index, message in failed))

    @contextlib.contextmanager
    def agreeing(self, phase: str) -> Iterator[None]:
        """Run the block in every process, then `agree` on whether it raised anywhere. A UserError becomes
        the agreed `error:` line; any other exception keeps its traceback here, the others name it."""
        try:
            yield
        except UserError as err:
            self.agree(phase, str(err))
            raise  # only reached with one process: agree raised otherwise
        except Exception as err:
            with contextlib.suppress(UserError):
                self.agree(phase, f"{type(err).__name__}: {err}")
            raise
        self.agree(phase, None)

    def any(self, phase: str, flag: bool) -> bool:
        """Whether `flag` is set in any process (e.g. a stop request), the same answer everywhere."""
        if self.count == 1:
            return flag
        return any(value for _, value in self._exchange(phase, "1" if flag else ""))

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Process 0's `data` in every process (two broadcasts over the devices: the length, the bytes)."""
        if self.count == 1:
            return data
        import numpy as np
        from jax.experimental import multihost_utils

        length = int(multihost_utils.broadcast_one_to_all(np.int64(len(data) if self.is_main else 0)))
        buffer = np.frombuffer(data, np.uint8) if self.is_main else np.zeros(length, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()

    # Failures -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def failures_shared(self) -> Iterator[None]:
        """Within the block, an exception in this process is published before it propagates, so the
        others stop at once instead of waiting in a collective for this one. A collective that fails
        here (a peer's connection closed) waits for the watcher to name the peer that stopped."""
        try:
            yield
        except (Stopped, SystemExit, KeyboardInterrupt):
            self.finish()  # every process stops here; a peer that exits first is not lost contact
            raise  # a stop is agreed by all processes; the others are not failures of the run
        except BaseException as err:
            if self.count == 1:
                raise
            with contextlib.suppress(Exception):
                coordination_client().key_value_set(f"{NAMESPACE}/failed/{self.index}", f"{type(err).__name__}: {err}")
            if isinstance(err, UserError):
                raise
            if type(err).__name__ == "JaxRuntimeError":
                time.sleep(self.peer_timeout + 3 * HEARTBEAT_SECONDS)  # the watcher exits first if a peer died
                first_line = str(err).splitlines()[0]
                raise UserError(f"a collective with the other processes failed ({first_line})") from None
            raise

    def finish(self) -> None:
        """Stop watching (before the processes part: a finished peer stops its heartbeat too)."""
        self._stop_watching.set()

    def _watch(self) -> None:
        """Renew this process's heartbeat key every second; exit with an `error:` line when a peer has
        published a failure, or its heartbeat has not changed for `peer_timeout` seconds."""
        client = coordination_client()
        beats, seen = 0, {peer: (None, time.monotonic()) for peer in range(self.count) if peer != self.index}
        while not self._stop_watching.wait(HEARTBEAT_SECONDS):
            try:
                beats += 1
                client.key_value_set(f"{NAMESPACE}/alive/{self.index}", str(beats), allow_overwrite=True)
                for key, message in client.key_value_dir_get(f"{NAMESPACE}/failed/"):
                    if int(key.rsplit("/", 1)[1]) != self.index:
                        _give_up(f"process {key.rsplit('/', 1)[1]} failed ({message})")
                now = time.monotonic()
                for peer, (last, since) in seen.items():
                    value = _try_get(client, f"{NAMESPACE}/alive/{peer}")
                    if value != last:
                        seen[peer] = (value, now)
                    elif now - since > self.peer_timeout:
                        _give_up(f"process {peer} sent no heartbeat for {self.peer_timeout:g} s (killed or hung)")
            except Exception as err:  # the coordination service (in process 0) is gone
                if self._stop_watching.is_set():
                    return
                _give_up(f"lost contact with process 0, which coordinates the run ({type(err).__name__})")


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as err:  # NOT_FOUND until the peer's first heartbeat
        if "NOT_FOUND" in str(err):
            return None
        raise


def _give_up(reason: str) -> None:
    """Leave at once from the watcher thread (the main thread may be blocked inside a collective)."""
    if getattr(_give_up, "done", False):
        return
    _give_up.done = True
    # A newline first: the main thread's progress bar may hold the current line (no newline of its own).
    print(f"\nerror: {reason}; stopping this process too", file=sys.stderr, flush=True)
    os._exit(PEER_FAILED_EXIT_STATUS)
