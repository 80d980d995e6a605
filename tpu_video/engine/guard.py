"""What watches stage 2's denoising loop: NaN/Inf checks after every step, checkpoints (every N steps and on
SIGTERM) and the state `--resume` continues from, agreed among processes on a multi-host run.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tpu_video.cli import Stopped, UserError, sigterm_handled
from tpu_video.runtime.distributed import Processes
from utils import CHECKPOINT_FILE, atomic_write, fingerprint_changes


class DenoiseGuard:
    """Watches a denoising loop: NaN/Inf checks after every step, checkpoints every N steps and on SIGTERM,
    and the state to resume from.

    A checkpoint holds the loop's tensors (latents and any scheduler carry), the CPU generator's state
    and the next step index, plus a fingerprint of the request and the stage-1 file, so a checkpoint
    cannot be resumed into a different run. Written atomically; removed once the final latents are saved.
    With several processes (tpu_video/runtime/distributed.py) only process 0 reads and writes it: the others get its
    bytes (`share_restored`), and all stop at the same step when any of them is sent SIGTERM.
    """

    def __init__(
        self,
        directory: Path,
        fingerprint: dict[str, Any],
        every: int = 0,
        resume: bool = False,
        processes: Processes | None = None,
    ) -> None:
        if every < 0:
            raise UserError(f"--checkpoint_every {every} must be >= 0")
        self.path = directory / CHECKPOINT_FILE
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        self.every = every
        self.resume = resume
        self.processes = processes or Processes()
        self.stop_requested = False
        self.batch_size = 1  # the batch this folder runs in (BatchGuard sets it), saved with a checkpoint
        self.resumed_batch_size: int | None = None  # the batch the checkpoint was saved in
        self._checkpoint = self._read() if resume and self.processes.is_main else None
        self.restored: tuple[int, dict[str, torch.Tensor]] | None = None
        if self._checkpoint is not None:
            self.restored = self._restore(self._checkpoint)

    def _read(self) -> bytes:
        if not self.path.is_file():
            raise UserError(f"--resume: there is no checkpoint {self.path}")
        return self.path.read_bytes()

    def _restore(self, data: bytes) -> tuple[int, dict[str, torch.Tensor]]:
        """(next step, tensors) from a checkpoint's bytes, which must belong to this request."""
        from safetensors.torch import load

        try:
            header_length = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8 : 8 + header_length]).get("__metadata__") or {}
            tensors = load(data)
        except Exception as err:  # safetensors raises several types for a damaged file
            raise UserError(f"--resume: {self.path} cannot be read ({err})") from None
        differ = fingerprint_differences(metadata.get("fingerprint"), self.fingerprint)
        if differ:
            raise UserError(
                f"--resume: {self.path} belongs to a different request or stage-1 file ({', '.join(differ)} "
                f"{'differs' if len(differ) == 1 else 'differ'}); rerun without --resume to start over"
            )
        self.resumed_batch_size = int(metadata.get("batch_size", 1))
        return int(metadata["next_step"]), tensors

    def share_restored(self) -> None:
        """After every process agreed its inputs are valid: all resume from process 0's checkpoint."""
        if self.resume and self.processes.count > 1:
            self.restored = self._restore(self.processes.broadcast_bytes(self._checkpoint))

    @property
    def start_step(self) -> int:
        """The first step this run computes (0 unless resuming)."""
        return self.restored[0] if self.restored is not None else 0

    def stop_handler(self) -> contextlib.AbstractContextManager:
        """Within the block SIGTERM only sets a flag; the loop saves and stops after the current step."""
        return sigterm_sets_stop(self)

    def save(self, next_step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write the checkpoint (process 0 only; the others hold the same state)."""
        if not self.processes.is_main:
            return
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items() if t is not None}
        metadata = {"next_step": str(next_step), "fingerprint": self.fingerprint, "batch_size": str(self.batch_size)}
        atomic_write(self.path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    def after_step(self, index: int, total: int, tensors: dict[str, torch.Tensor], more=dict, where: str = "") -> None:
        """Call with the loop state after step `index` (0-based) of `total`; `tensors["latents"]` is checked.
        `more()` gives further tensors to save, fetched only when a checkpoint is written (e.g. device state;
        every process fetches them, since that may take a collective). `where` names the loop in the messages
        (DenoiseLoop.label: Wan Animate's segment)."""
        step = f"step {index + 1} of {total}{f' in {where}' if where else ''}"
        if not tensors["latents"].isfinite().all():
            raise UserError(f"{step} produced NaN or Inf latents; nothing was written")
        done = index + 1
        stop = self.processes.any(f"stop/{done}", self.stop_requested)
        due = self.every and done % self.every == 0 and done < total
        if stop or due:
            tensors = {**tensors, **more()}
        if stop:
            self.save(done, tensors)
            self.processes.agree(f"saved/{done}", None)  # no process leaves before the checkpoint exists
            raise Stopped(f"SIGTERM after {step}; saved {self.path}. Continue with the same command plus --resume")
        if due:
            self.save(done, tensors)

    def finished(self) -> None:
        if self.processes.is_main:
            self.path.unlink(missing_ok=True)


def sigterm_sets_stop(target) -> contextlib.AbstractContextManager:
    """Within the block SIGTERM sets `target.stop_requested` (a guard, or a whole run of batches)."""

    def request_stop(signum, frame):
        target.stop_requested = True

    return sigterm_handled(request_stop)


def fingerprint_differences(saved: str | None, ours: str) -> list[str]:
    """The keys in which a checkpoint's fingerprint differs from this run's (empty: it is this run's), compared
    as utils.fingerprint_changes compares a stage-2 section's (null and absent equal: a stage 2 before the
    families' options left utils.Request wrote every family's keys, null where unset)."""
    try:
        theirs = json.loads(saved) if saved is not None else None
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):
        return ["the fingerprint (unreadable)"]
    return sorted(fingerprint_changes(theirs, json.loads(ours)))
