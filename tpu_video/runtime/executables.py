"""Saved executables: a compiled program written to disk after its first compile and loaded by the next
process instead of tracing and compiling it again (`--executables auto|off|DIR`).

An entry is keyed by the digest of its program's part digests (tpu_video/runtime/program_key.py). It holds the
serialized executable (jax.experimental.serialize_executable), a digest of those bytes, the key again and the messages
of the program's checks (tpu_video/program_checks.py); beside it, a small JSON file with the digest of each
part, so that a miss can say which part differs from the entries saved for the same program. A missing, damaged or
foreign entry, or one the installed JAX cannot load, logs one line and the program is compiled as if there were no
store: a store can cost a compile, never a wrong result."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import time
from pathlib import Path

from tpu_video.cli import UserError, log
from tpu_video.cli.folders import cache_root
from tpu_video.runtime.program_key import digest
from tpu_video.workarounds.jax import lapack_ready

ENTRY_FORMAT = 1
SUFFIX = ".executable"
ABANDONED_SECONDS = 3600  # a temporary this old belongs to no running save


AUTO_LIMIT_VARIABLE = "TPU_VIDEO_EXECUTABLES_GIB"
AUTO_LIMIT_GIB = 20.0  # the auto store's default size


def store_from_flag(value: str, platform: str) -> ExecutableStore:
    """`--executables`: auto (a folder per platform in this tool's cache, kept under $TPU_VIDEO_EXECUTABLES_GIB
    by dropping the least recently used entries), off, or a folder (never pruned: the user's)."""
    if value == "off":
        return ExecutableStore("off", None)
    if value == "auto":
        limit = _auto_limit()
        return ExecutableStore("auto", cache_root() / "executables" / platform, limit_bytes=limit)
    return ExecutableStore("folder", Path(value).expanduser())


def _auto_limit() -> int:
    text = os.environ.get(AUTO_LIMIT_VARIABLE, "").strip() or str(AUTO_LIMIT_GIB)  # set but empty: unset
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not (gib > 0 and math.isfinite(gib)):
        raise UserError(
            f"${AUTO_LIMIT_VARIABLE}={text!r}: give the auto executable store's size in GiB, a finite number above 0"
        )
    return int(gib * 2**30)


class ExecutableStore:
    """Loads and saves compiled programs in `directory` (None: off), counting what happened. With
    `limit_bytes`, each save drops the least recently used entries (a load counts as a use) until the
    folder's entries fit, the new one always kept."""

    def __init__(self, mode: str, directory: Path | None, limit_bytes: int | None = None) -> None:
        self.mode = mode
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.counts = {"hits": 0, "misses": 0, "saved": 0, "unusable": 0, "unsaveable": 0, "failed": 0}

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def report(self) -> dict:
        """The config's record (the folder is logged, not recorded: configs hold no host paths)."""
        return {"mode": self.mode, **self.counts}

    def load(self, name: str, parts: dict[str, str], devices) -> tuple | None:
        """(executable, check messages) saved for `parts` (each part's digest) on `devices`, or None (the
        line says why)."""
        from jax.experimental import serialize_executable

        key = digest(parts)
        path = self.directory / f"{key}{SUFFIX}"
        if not path.exists():
            self.counts["misses"] += 1
            log(f"executables: no saved {name} for this run ({self._nearest(name, parts)}); compiling it")
            return None
        try:
            entry = pickle.loads(path.read_bytes())
            if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT or entry.get("key") != key:
                raise ValueError("it is not an entry of this store's format for this key")
            if hashlib.sha256(entry["payload"]).hexdigest() != entry["payload_sha256"]:
                raise ValueError("its bytes do not match their digest")
            lapack_ready()  # a CPU program calling LAPACK crashes when run without it (workarounds/jax.py)
            executable = serialize_executable.deserialize_and_load(
                entry["payload"], entry["in_tree"], entry["out_tree"], execution_devices=list(devices)
            )
        except Exception as error:  # a damaged or foreign entry must cost a compile, nothing else
            self.counts["misses"] += 1
            self.counts["unusable"] += 1
            why = f"{type(error).__name__}: {error}"
            log(f"executables: the saved {name} ({path.name}) is unusable ({why}); compiling it")
            return None
        self.counts["hits"] += 1
        _touch(path)  # a use: the least recently used entries go first
        log(f"executables: loaded the saved {name}")
        return executable, tuple(entry["messages"])

    def save(self, name: str, parts: dict[str, str], executable, messages: tuple[str, ...]) -> None:
        """Write the entry (atomically: a reader never sees half of one); failures are logged, not raised."""
        from jax.experimental import serialize_executable

        key = digest(parts)
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(executable)
        except Exception as error:
            self.unsaveable(name, f"{type(error).__name__}: {error}")
            return
        entry = {
            "format": ENTRY_FORMAT,
            "key": key,
            "name": name,
            "payload": payload,
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
            "in_tree": in_tree,
            "out_tree": out_tree,
            "messages": list(messages),
        }
        summary = {"name": name, "parts": parts}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.directory / f"{key}{SUFFIX}", pickle.dumps(entry))
            _write_atomically(self.directory / f"{key}.json", json.dumps(summary, indent=1).encode())
        except OSError as error:
            self.counts["failed"] += 1
            log(f"executables: could not save {name} in {self.directory} ({error})")
            return
        self.counts["saved"] += 1
        log(f"executables: saved {name} ({len(payload) / 2**20:.1f} MiB)")
        if self.limit_bytes is not None:
            self._prune(keep=key)

    def _prune(self, keep: str) -> None:
        """Drop the least recently used entries (and their summaries) until the entries fit `limit_bytes`, and
        temporaries a killed process left (an hour old)."""
        for temporary in self.directory.glob(".*.tmp"):  # an entry's or its summary's
            with contextlib.suppress(OSError):  # removed meanwhile, or not ours to remove
                if time.time() - temporary.stat().st_mtime > ABANDONED_SECONDS:
                    temporary.unlink()
        entries = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:  # removed meanwhile by another process
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        dropped = 0
        for _, size, path in sorted(entries):
            if total <= self.limit_bytes:
                break
            if path.name == f"{keep}{SUFFIX}":
                continue
            for stale in (path, path.with_suffix(".json")):
                stale.unlink(missing_ok=True)
            total -= size
            dropped += 1
        if dropped:
            limit = f"{self.limit_bytes / 2**30:g} GiB (${AUTO_LIMIT_VARIABLE})"
            log(f"executables: dropped the {dropped} least recently used entries to keep the store under {limit}")

    def unsaveable(self, name: str, why: str) -> None:
        self.counts["unsaveable"] += 1
        log(f"executables: {name} cannot be saved ({why}); compiling it")

    def _nearest(self, name: str, parts: dict) -> str:
        """Which parts differ from the closest entry saved for the same program, for the miss's line."""
        differences = []
        for summary_path in self.directory.glob("*.json") if self.directory.is_dir() else ():
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError):
                continue
            if summary.get("name") == name:
                saved = summary.get("parts", {})
                differences.append(
                    sorted(part for part in parts.keys() | saved.keys() if parts.get(part) != saved.get(part))
                )
        if not differences:
            return "none saved yet"
        closest = min(differences, key=len)
        return f"the closest of {len(differences)} saved differs in: {', '.join(closest)}"


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only store still serves its entries
        pass


def _write_atomically(path: Path, data: bytes) -> None:
    """Write through a temporary beside `path`, removed when the write fails (a full disk would otherwise
    keep it, and stay full)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
