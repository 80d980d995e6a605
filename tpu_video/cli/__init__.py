"""The conventions of the three stage CLIs, which the code under them raises and logs into: one `error:`
line and exit 2 for what the user can fix (`UserError`, argparse errors included), `stopped:` lines for
SIGTERM and Ctrl-C, finite float flags, the reference scripts' flag spellings, dtypes by name, and
timestamped log lines; `options` holds the request options' declarations (`Option`), from which the stages
build their flags; `folders` the stage folders a run holds and the stale outputs it removes. It imports
nothing of the project, so everything may use it."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a dtype is made, not by what imports these conventions
    import torch

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # our names -> torch's attribute names
DTYPE_SPELLINGS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # torch's and diffusers' names

# The reference scripts' spellings of our flags, so their users' command lines keep working: one place
# for all of them; argparse accepts each and `--help` lists it beside ours.
REFERENCE_ALIASES = {"--model": ("--model_id",), "--num_frames": ("--frames", "--video_length")}


def flag_names(flag: str) -> list[str]:
    """`flag` and its reference-script aliases, for `add_argument`."""
    return [flag, *REFERENCE_ALIASES.get(flag, ())]


def dtype_flag(name: str) -> str:
    """`--dtype` as typed: torch's spellings become ours (what configs record); anything else is left for
    parse_dtype to refuse."""
    return DTYPE_SPELLINGS.get(name, name)


_START = time.monotonic()


class UserError(Exception):
    """A problem the user can fix (bad flag, missing or wrong file); reported as one `error:` line, exit 2."""


class Stopped(Exception):
    """The run was asked to stop (SIGTERM, e.g. a preemption notice) and saved what it had."""


STOPPED_EXIT_STATUS = 143  # 128 + SIGTERM, what a shell reports for a terminated process
INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports after Ctrl-C


class StageArgumentParser(argparse.ArgumentParser):
    """argparse with the stages' error convention: a bad flag is one `error:` line (pointing at --help) and
    exit status 2, not a usage block whose last line starts with the program's name."""

    # Flags another stage takes (`--condition_strength` given to stage 2): flag -> the sentence that says so and
    # where to look.
    elsewhere: dict[str, str] = {}

    def error(self, message: str):
        unknown = message.removeprefix("unrecognized arguments: ").split() if "unrecognized" in message else []
        if message.startswith("ambiguous option: "):  # another stage's flag that begins one of ours (--mode)
            unknown = message.split()[2:3]
        owned = [self.elsewhere[flag.split("=")[0]] for flag in unknown if flag.split("=")[0] in self.elsewhere]
        # Another stage's flag: its sentence names that stage (this one's --help does not list the flag).
        said = owned[0] if owned else f"{message} (see {self.prog} --help)"
        print(f"error: {said}", file=sys.stderr, flush=True)
        sys.exit(2)


def stage_parser(script: str, description: str | None) -> StageArgumentParser:
    """A stage's parser, named after its file (also when run in-process), with its docstring as help."""
    formatter = argparse.RawDescriptionHelpFormatter
    return StageArgumentParser(prog=Path(script).name, description=description, formatter_class=formatter)


def finite_float(text: str) -> float:
    """An argparse type: a float that is neither NaN nor infinite (JSON and the maths need finite numbers)."""
    value = float(text)  # argparse words a ValueError as "invalid finite_float value"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def executables_flag(text: str) -> str:
    """`--executables`: auto, off, or a folder (which must not be an existing file)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give auto, off or a folder")
    if text not in ("auto", "off") and Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text


def plan_target(text: str) -> str:
    """`--plan`: a TPU name; an empty one is refused (taken as no --plan, it would run the whole stage)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a TPU, e.g. v6e-8 or v6e:2x4")
    return text


def writable_file(text: str) -> str:
    """`--plan_json`: a file the report can be written to, checked before anything compiles."""
    path = Path(text).expanduser()
    if not text.strip():
        raise argparse.ArgumentTypeError("give a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"its folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written")
    return str(path)  # as checked: a quoted ~ is expanded here, not by the writer


def executables_folder(text: str) -> str:
    """`--save_executables`: a folder (made if missing), checked before anything compiles."""
    path = Path(text).expanduser()
    if not text.strip():
        raise argparse.ArgumentTypeError("give a folder")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written ({existing} is not writable)")
    return str(path)


def add_executables_argument(parser) -> None:
    """`--executables`, the same on every stage that runs torchax programs (tpu_video/runtime/executables.py)."""
    parser.add_argument(
        "--executables",
        type=executables_flag,
        default="auto",
        metavar="auto|off|DIR",
        help="torchax: save each compiled program and load it in later runs instead of tracing and compiling "
        "it again; auto: a folder per platform in ~/.cache/tpu-video/executables (or $TPU_VIDEO_CACHE), kept "
        "under $TPU_VIDEO_EXECUTABLES_GIB (default 20) by dropping the least recently used; "
        "off: neither load nor save (default: %(default)s)",
    )


def add_plan_arguments(parser, compiles: str, more: str = ""):
    """`--plan`, `--plan_json` and `--save_executables`, the same on every stage (tpu_video/planning/); `compiles` says
    what the stage's plan compiles, `more` is added to --plan's help. Returns the group, for a stage's own."""
    planning = parser.add_argument_group("planning for a TPU (from any host, no TPU, no weights)")
    planning.add_argument(
        "--plan",
        metavar="TPU",
        type=plan_target,
        help=f"compile {compiles} for a TPU slice and report HBM fit, then exit (0: fits, 3: does not fit); writes "
        "nothing but what --plan_json and --save_executables ask for. TPU: an accelerator type (v5litepod-8, v5e-8, "
        f"v5p-8, v6e-8, v6e-16, tpu7x-8, ...) or a topology (v6e:2x4){more}",
    )
    planning.add_argument("--plan_json", metavar="FILE", type=writable_file, help="also save the plan's report as JSON")
    planning.add_argument(
        "--save_executables",
        metavar="DIR",
        type=executables_folder,
        help="with --plan (a single-host slice): also save the compiled programs in DIR, keyed as a --backend "
        "torchax run on that TPU keys them, so a run there with --executables DIR loads them instead of compiling",
    )
    return planning


def refuse_planning_flags(args, names=("plan_json", "save_executables"), why: str = "") -> None:
    """Without --plan, the flags `names` (add_plan_arguments' and a stage's own) are an error."""
    given = [f"--{name}" for name in names if getattr(args, name) is not None]
    if given:
        raise UserError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --plan{why}")


def _terminated(signum, frame):
    raise Stopped("terminated (SIGTERM); no partial file was written")


@contextlib.contextmanager
def sigterm_handled(handler: Callable) -> Iterator[None]:
    """Within the block SIGTERM calls `handler(signum, frame)`; the previous handler comes back after. Off the
    main thread (the Python API in a server's thread) no handler can be set, and none is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sigterm_stops() -> contextlib.AbstractContextManager:
    """Within the block SIGTERM raises Stopped where the run is, as Ctrl-C does (writes are atomic: their
    temporaries are removed on the way out); stage 2's loop replaces it with a stop after the current step."""
    return sigterm_handled(_terminated)


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's main(): user errors become one `error:` line and exit status 2; a requested stop one
    `stopped:` line and status 143 (130 after Ctrl-C); bugs keep their traceback. SIGTERM stops the stage
    where it is, as Ctrl-C does (writes are atomic: their temporaries are removed on the way out); stage 2's
    loop replaces this with a stop after the current step and a checkpoint."""
    _IN_RUN_CLI["active"] = True
    try:
        with sigterm_stops():
            main()
    except UserError as err:  # one line, whatever a wrapped library message held
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Stopped as stop:
        print(f"stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(STOPPED_EXIT_STATUS)
    except KeyboardInterrupt:  # writes are atomic, so nothing partial is left
        print("\nstopped: interrupted (Ctrl-C); no partial file was written", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_STATUS)
    finally:
        _IN_RUN_CLI["active"] = False
        run_ended()


_IN_RUN_CLI = {"active": False}  # a stage's command line is running (not the Python API in someone's process)


_AT_RUN_END: list[Callable[[], None]] = []


def at_run_end(callback: Callable[[], None]) -> None:
    """Call `callback` when the stage run ends, however it ends (run_cli, the API): what a run holds (the
    stage folders: folders.hold) is let go for the next run in this process."""
    if callback not in _AT_RUN_END:
        _AT_RUN_END.append(callback)


def run_ended() -> None:
    for callback in _AT_RUN_END:
        callback()


_LOGGING = {"enabled": True}


def set_logging(enabled: bool) -> None:
    """Turn this process's log lines and progress bars on or off (off in all but process 0 of a
    multi-host run, so one log tells the story)."""
    _LOGGING["enabled"] = enabled


def logging_enabled() -> bool:
    return _LOGGING["enabled"]


def log(message: str) -> None:
    """Plain log line prefixed with seconds since the process started."""
    if _LOGGING["enabled"]:
        print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


STILL_WORKING_SECONDS = 30.0
STOP_GRACE_SECONDS = 1.0
_STOPS = {
    signal.SIGTERM: ("terminated (SIGTERM)", STOPPED_EXIT_STATUS),
    signal.SIGINT: ("interrupted (Ctrl-C)", INTERRUPTED_EXIT_STATUS),
}


@contextlib.contextmanager
def still_working(what: str, every: float = STILL_WORKING_SECONDS) -> Iterator[None]:
    """Around a long call that prints nothing (a compile: the TPU compiler took minutes on published models): a
    log line every `every` seconds naming it and the time it has taken, so a quiet run is not taken for a hung one.

    A signal's Python handler runs only once the main thread is back in Python, so SIGTERM or Ctrl-C during
    such a call waited for its end (minutes). Here the signal also wakes this block's thread (through
    `signal.set_wakeup_fd`); if the call has not returned a second later, the thread prints the stop's line and
    ends the process with its exit status (143, 130): such a call writes nothing, and the stage folders' lock
    goes with the process. Only under a stage's command line (run_cli: the Python API's caller keeps its
    process and gets Stopped once the call returns), and not where the signal asks for a stop after the
    current step (stage 2's loop)."""
    done, start = threading.Event(), time.monotonic()
    watch = _SignalWatch() if threading.current_thread() is threading.main_thread() else None

    def beat() -> None:
        next_beat = start + every
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            if watch is None:
                done.wait(timeout)
                arrived = b""
            else:
                arrived = watch.wait(timeout)
            if done.is_set():
                return
            stop = next((_STOPS[number] for number in arrived if _stops_where_it_is(number)), None)
            if stop is not None and not done.wait(STOP_GRACE_SECONDS):
                sys.stdout.flush()
                print(f"stopped: {stop[0]} while {what}; no partial file was written", file=sys.stderr, flush=True)
                os._exit(stop[1])
            if time.monotonic() >= next_beat:
                log(f"{what}: still working ({time.monotonic() - start:.0f} s)")
                next_beat += every

    thread = threading.Thread(target=beat, name="still-working", daemon=True)
    thread.start()
    try:
        yield
    finally:
        try:
            done.set()
            if watch is not None:
                watch.wake()
            thread.join()
        finally:  # even if a signal's handler raises in between
            if watch is not None:
                watch.close()


def _stops_where_it_is(number: int) -> bool:
    """Whether signal `number` now stops the run where it is (run_cli's SIGTERM, Python's Ctrl-C), not after
    the current step with a checkpoint (stage 2's loop: engine/guard.py), which a compile must not cut short."""
    handlers = {signal.SIGTERM: _terminated, signal.SIGINT: signal.default_int_handler}
    return _IN_RUN_CLI["active"] and number in handlers and signal.getsignal(number) is handlers[number]


class _SignalWatch:
    """The numbers of the signals that arrive, for another thread to read: the C-level signal handler writes
    each one to a socket (`signal.set_wakeup_fd`), whichever thread the signal interrupts. Made on the main
    thread only, where a wakeup fd can be set; `close` gives the previous one back."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._reader, select.POLLIN)
        self._previous = signal.set_wakeup_fd(self._writer.fileno())

    def wait(self, seconds: float) -> bytes:
        """The signal numbers that arrived within `seconds` (empty: none, or `wake`)."""
        return self._reader.recv(64) if self._poll.poll(seconds * 1000) else b""

    def wake(self) -> None:
        """End a `wait` at once (0 is no signal's number)."""
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)  # before the socket it points at closes
        self._reader.close()
        self._writer.close()


def parse_dtype(name: str) -> torch.dtype:
    """`--dtype` as a torch dtype."""
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)} (or {', '.join(DTYPE_SPELLINGS)})")
    import torch

    return getattr(torch, DTYPES[name])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
