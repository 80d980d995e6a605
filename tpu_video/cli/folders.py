"""The stage folders a run works in: one writer at a time (`hold`: a lock a stage takes before it reads or
writes a folder, released when the process ends), and the later stages' outputs a new output makes stale
(`without_stale_outputs`), and this tool's per-user cache folder (`cache_root`). No torch: the file contract
(utils.py) and the stages' parsers use it."""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import UserError, at_run_end, log

LOCK_FILE = ".tpu-video.lock"
_HELD: dict[Path, tuple[int, bool]] = {}  # resolved folder -> (lock file descriptor, exclusive)


def cache_root() -> Path:
    """This tool's per-user cache: materialized presets, published configs, the JAX compilation cache.
    TPU_VIDEO_CACHE moves it (the tests give each session its own)."""
    return Path(os.environ.get("TPU_VIDEO_CACHE") or Path.home() / ".cache" / "tpu-video")


def hold(directory: Path, *, write: bool) -> None:
    """Hold `directory` until the stage run ends: to write it (one holder), or to read it (any number of
    readers, no writer). A folder another run holds against this one is one error naming that run, at once:
    two stage-2 runs into one folder both wrote and the last won; stage 3 beside a stage 2 rewriting its
    folder read a half-written file. A folder that does not exist yet, or a read-only one read, is not held
    (nothing can write it); nor is one on a file system without locks (a note says so)."""
    key = directory.resolve()
    held = _HELD.get(key)
    if held is not None and (held[1] or not write):
        return
    if held is not None:  # read, now to be written: let go first (a shared lock is not upgraded in place)
        os.close(_HELD.pop(key)[0])
    while True:
        try:
            fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            if write and directory.is_dir():
                raise UserError(f"output folder {directory} is not writable") from None
            return
        if not _lock(fd, directory, write):
            return
        try:  # the file locked must still be the folder's: a holder letting go removes it (release)
            if os.fstat(fd).st_ino == os.stat(directory / LOCK_FILE).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    what = "writing" if write else "reading"
    note = f"{Path(sys.argv[0]).name} (process {os.getpid()}) {what} it since {time.strftime('%H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    _HELD[key] = (fd, write)
    at_run_end(release)


def _lock(fd: int, directory: Path, write: bool) -> bool:
    """flock without waiting: True when locked; False (fd closed, a note logged) where the file system has
    no locks; a UserError naming the holder where another run has it."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if write else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another run"
        os.close(fd)
        raise UserError(
            f"{directory} is in use: {holder}; wait for it to finish, or give this run another folder"
        ) from None
    except OSError as err:  # NFS without its lock daemon, some FUSE and CIFS mounts
        os.close(fd)
        log(f"note: {directory} cannot be locked on its file system ({err.strerror}); runs there are not kept apart")
        return False


@atexit.register
def release() -> None:
    """Let go of every folder held: at the end of each stage run (cli.run_cli, the API) and at exit. Each
    lock file no other process holds is removed (taken exclusively first, so no reader loses it; one who
    opened it meanwhile finds it gone and makes another: hold); the kernel releases a process's locks
    however it ends, and a file left behind is harmless."""
    import fcntl

    for folder, (fd, _) in list(_HELD.items()):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (folder / LOCK_FILE).unlink(missing_ok=True)
        except OSError:
            pass
        os.close(fd)
    _HELD.clear()


# Later stages' sections: the key recording the checksum of the output they were made from, and the keys
# naming the files they wrote (a file name, or a record holding one under "file").
MADE_FROM = {"stage2": ("stage1", "stage1_sha256"), "stage3": ("stage2", "latents_sha256")}
OUTPUT_KEYS = {"stage2": ("file",), "stage3": ("file", "preview", "frames_file")}


def without_stale_outputs(directory: Path, sections: dict[str, Any], stage: str, sha256: str | None) -> dict:
    """The sections with those of later stages made from another output of `stage` than its new one (checksum
    `sha256`) dropped, and their files in `directory` removed, saying so: an old model's mp4 beside a new
    stage 1 would pass for the new video. A stage made from a dropped one goes too."""
    kept, changed = dict(sections), {stage: sha256}
    for later, (earlier, key) in MADE_FROM.items():
        if later not in kept or earlier not in changed:
            continue
        if changed[earlier] is not None and kept[later].get(key) == changed[earlier]:
            continue  # made from the same bytes (a deterministic rerun): still current
        section = kept.pop(later)
        changed[later] = None
        removed = []
        for name_key in OUTPUT_KEYS[later]:
            value = section.get(name_key)
            name = value.get("file") if isinstance(value, dict) else value
            # a bare file name only: a hand-edited "../x" must not reach outside the folder
            if isinstance(name, str) and Path(name).name == name and (directory / name).is_file():
                (directory / name).unlink()
                removed.append(name)
        if removed:
            log(f"removed {', '.join(removed)}: stage {later[-1]}'s outputs from what stage {earlier[-1]} wrote before")
    return kept
