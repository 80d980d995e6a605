"""The stage-file contract (safetensors + generation_config.json), user errors, logging and timing.

Imported by all three stages, so it must not import JAX.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
CONFIG_FILE = "generation_config.json"
STAGE1_FILE = "stage1_embeddings.safetensors"
STAGE2_FILE = "stage2_latents.safetensors"
VIDEO_FILE = "output_video.mp4"
DEFAULT_OUTPUT_DIR = "./stage_outputs"

# The generation request: top-level keys of generation_config.json that later stages may override.
REQUEST_KEYS = (
    "height",
    "width",
    "num_frames",
    "fps",
    "num_inference_steps",
    "guidance_scale",
    "seed",
    "flow_shift",
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_START = time.monotonic()


class UserError(Exception):
    """A problem the user can fix (bad flag, missing or wrong file); reported as one `error:` line, exit 2."""


class Stopped(Exception):
    """The run was asked to stop (SIGTERM, e.g. a preemption notice) and saved what it had."""


STOPPED_EXIT_STATUS = 143  # 128 + SIGTERM, what a shell reports for a terminated process


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's main(): user errors become one `error:` line and exit status 2; a requested stop one
    `stopped:` line and status 143; bugs keep their traceback."""
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Stopped as stop:
        print(f"stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(STOPPED_EXIT_STATUS)


def log(message: str) -> None:
    """Plain log line prefixed with seconds since the process started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


# Library warnings known to be harmless here, by exact message start. Nothing else is hidden.
HARMLESS_WARNINGS = (
    # jax without x64 narrows torch's int64 tensors (timesteps, token ids) to int32; values stay small.
    (UserWarning, "Explicitly requested dtype int64 requested in "),
    # JAX warns on any fork; imageio-ffmpeg's subprocess forks and immediately execs ffmpeg.
    (RuntimeWarning, "os.fork() was called. os.fork() is incompatible with multithreaded code"),
)


def filter_harmless_warnings() -> None:
    import re
    import warnings

    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


class Timer:
    """Collects named wall-clock phases ({"load": 1.2, "denoise": 30.5}) and per-step seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.step_seconds: list[float] = []
        self._start = time.perf_counter()

    def finish(self) -> dict[str, float]:
        """Add the stage's `total` and print the phases as a small table; returns the phases."""
        total = time.perf_counter() - self._start
        self.seconds["other"] = round(max(total - sum(self.seconds.values()), 0.0), 4)  # imports, setup, checks
        self.seconds["total"] = round(total, 4)
        width = max(len(name) for name in self.seconds)
        log("timing (seconds):")
        for name, seconds in self.seconds.items():
            print(f"    {name:<{width}}  {seconds:9.3f}", flush=True)
        if self.step_seconds:
            steps = sorted(self.step_seconds)
            print(f"    {'median step':<{width}}  {steps[len(steps) // 2]:9.3f}", flush=True)
        return self.seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 4)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def library_versions(*names: str) -> dict[str, str]:
    """Versions of the installed distributions that shaped a stage's output."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temp file in the same folder and rename, so a crash never leaves a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keep the real extension last: ffmpeg picks the container from it.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; stage files are meant to be copied and shared
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_writable_dir(directory: Path) -> None:
    """Create the output folder, or fail with a user error before any heavy work."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create output folder {directory}: {err.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise UserError(f"output folder {directory} is not writable")


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Save tensors (in their own dtype) atomically; return the config record describing the file."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "tensors": {name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for name, t in tensors.items()},
    }


def read_tensors(directory: Path, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load a stage file described by `record`, verifying its checksum, names, shapes and dtypes."""
    path = directory / record["file"]
    if not path.is_file():
        raise UserError(f"{path} is missing")
    if sha256_file(path) != record["sha256"]:
        raise UserError(f"{path} does not match the sha256 recorded in {CONFIG_FILE} (truncated or changed copy?)")
    tensors = load_file(str(path))
    for name, spec in record["tensors"].items():
        if name not in tensors:
            raise UserError(f"{path} has no tensor {name!r}")
        found = {"shape": list(tensors[name].shape), "dtype": dtype_name(tensors[name].dtype)}
        if found != spec:
            raise UserError(f"{path}: tensor {name!r} is {found}, {CONFIG_FILE} says {spec}")
    return tensors


def read_config(directory: Path, needs: str | None = None) -> dict[str, Any]:
    """Read generation_config.json; `needs` names a stage section that must be present (e.g. "stage1")."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        hint = " (run stage1_text_encoder.py first)" if needs else ""
        raise UserError(f"{path} is missing{hint}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from None
    version = config.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UserError(
            f"{path} was written by a newer version of this tool (format_version {version}, this one reads "
            f"{FORMAT_VERSION}); upgrade to read it"
        )
    if version != FORMAT_VERSION:
        raise UserError(f"{path} has format_version {version!r}; this tool reads format_version {FORMAT_VERSION}")
    if needs and needs not in config:
        raise UserError(f"{path} has no {needs!r} section (run the {needs} script first)")
    return config


def write_config(directory: Path, config: dict[str, Any]) -> None:
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"
    _atomic_write(directory / CONFIG_FILE, lambda tmp: tmp.write_text(text))


def add_request_arguments(parser, *, for_later_stage: bool) -> None:
    """The generation-request flags. In stage 1 an omitted flag takes the family default; in a later
    stage it keeps the value from generation_config.json (and a given one is recorded as an override)."""
    where = "default: from generation_config.json" if for_later_stage else "default: the model family's"
    group = parser.add_argument_group("generation request", f"({where})")
    group.add_argument("--height", type=int, help="video height in pixels")
    group.add_argument("--width", type=int, help="video width in pixels")
    group.add_argument(
        "--num_frames", type=int, help="number of frames (8n+1 for CogVideoX, 4n+1 for HunyuanVideo-1.5)"
    )
    group.add_argument("--fps", type=int, help="frames per second of the mp4")
    group.add_argument("--num_inference_steps", type=int, help="denoising steps")
    group.add_argument(
        "--guidance_scale",
        type=float,
        help="classifier-free guidance scale (CogVideoX: <= 1 turns CFG off; HunyuanVideo-1.5: 1)",
    )
    group.add_argument(
        "--flow_shift",
        type=float,
        help="flow-matching timestep shift (HunyuanVideo-1.5 only; 5.0 at 480p, 9.0 at 720p)",
    )
    group.add_argument(
        "--seed",
        type=int,
        help="seed of the CPU generator that draws the initial noise" + ("" if for_later_stage else " (default: 42)"),
    )


def request_flags(args) -> dict[str, Any]:
    return {key: getattr(args, key) for key in REQUEST_KEYS}


def apply_request_overrides(config: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """Set request keys given on a later stage's command line; return {key: [old, new]} for the record."""
    overrides = {}
    for key, value in flags.items():
        if value is not None and config.get(key) != value:
            overrides[key] = [config.get(key), value]
            config[key] = value
    return overrides


def step_progress(steps, timer: Timer, desc: str = "denoise", trace=None, trace_steps: int = 3):
    """Yield (index, step) under a tqdm bar showing the last step's seconds, the running mean and ETA.

    A step's time runs from one yield to the next, so it includes the device sync the caller does when
    it pulls the step's result back to the host. `trace` (a context manager, e.g. a profiler trace) is
    held open around the first `trace_steps` steps.
    """
    from tqdm import tqdm

    tracing = contextlib.ExitStack()
    bar = tqdm(total=len(steps), desc=desc, unit="step", dynamic_ncols=True)
    with timer.phase(desc), tracing:
        for index, step in enumerate(steps):
            if index == 0 and trace is not None:
                tracing.enter_context(trace)
            start = time.perf_counter()
            yield index, step
            timer.step_seconds.append(round(time.perf_counter() - start, 4))
            if index + 1 == trace_steps:
                tracing.close()
            mean = sum(timer.step_seconds) / len(timer.step_seconds)
            bar.set_postfix_str(f"step {timer.step_seconds[-1]:.3f}s avg {mean:.3f}s")
            bar.update()
    bar.close()


def write_preview_png(path: Path, frames, count: int = 8, columns: int = 4) -> tuple[int, int]:
    """Save `count` evenly spaced frames of uint8 video (F, H, W, 3) as one grid image, atomically.

    Returns the grid's (rows, columns)."""
    import numpy as np
    from PIL import Image

    total, height, width, _ = frames.shape
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(int))
    columns = min(columns, len(picks))
    rows = -(-len(picks) // columns)
    grid = np.zeros((rows * height, columns * width, 3), dtype=np.uint8)
    for cell, index in enumerate(picks):
        row, column = divmod(cell, columns)
        grid[row * height : (row + 1) * height, column * width : (column + 1) * width] = frames[index]
    _atomic_write(path, lambda tmp: Image.fromarray(grid).save(tmp, format="PNG"))
    return rows, columns


def compile_cache_dir() -> Path:
    """JAX_COMPILATION_CACHE_DIR, else a folder in this tool's per-user cache."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    root = os.environ.get("TPU_VIDEO_CACHE") or Path.home() / ".cache" / "tpu-video"
    return Path(root) / "jax-compilation-cache"


class CompileCache:
    """The persistent JAX compilation cache, on for every compile in this process, counting hits and misses.

    Imports JAX, so only the JAX-side stages call it. Compiles of any size are cached: the defaults
    skip entries that compiled in under a second, which is most of what a CPU test run compiles.
    """

    def __init__(self, enabled: bool = True) -> None:
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        self.enabled = enabled
        self.directory = compile_cache_dir()
        self.hits = self.misses = 0
        if enabled:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", str(self.directory))
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.monitoring.register_event_listener(self._count)
        else:
            jax.config.update("jax_enable_compilation_cache", False)
        # JAX settles its cache state at the first compile, and `import torchax` already compiles
        # (with $JAX_COMPILATION_CACHE_DIR if set): start over so the settings above take effect.
        compilation_cache.reset_cache()

    def _count(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def report(self) -> dict[str, object]:
        """Stop counting; a summary for the config (the folder is logged, not recorded: configs hold no
        host paths)."""
        if self.enabled:
            import jax

            jax.monitoring.unregister_event_listener(self._count)
            log(f"compile cache {self.directory}: {self.hits} hits, {self.misses} misses")
        return {"enabled": self.enabled, "hits": self.hits, "misses": self.misses}


def write_mp4(path: Path, frames, fps: int) -> None:
    """Encode uint8 frames (F, H, W, 3) as H.264 mp4 with imageio-ffmpeg, atomically."""
    import imageio_ffmpeg

    _, height, width, _ = frames.shape

    def write(tmp: Path) -> None:
        writer = imageio_ffmpeg.write_frames(
            str(tmp),
            (width, height),
            fps=fps,
            codec="libx264",
            pix_fmt_out="yuv420p",
            macro_block_size=1,
            quality=8,
            ffmpeg_log_level="error",
        )
        writer.send(None)
        for frame in frames:
            writer.send(frame.tobytes())
        writer.close()

    _atomic_write(path, write)


class TorchRuntime:
    """Runs modules eagerly in PyTorch on one device (CPU or CUDA); the no-JAX backend of stage 3."""

    name = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def profile_trace(self):
        return None

    def compile(self, module: torch.nn.Module, rules=None):
        """`rules` (a sharding table) means nothing on one torch device."""
        return module.to(self.device)

    def to_device(self, tree, spec=None):
        return torch.utils._pytree.tree_map(lambda t: t.to(self.device) if torch.is_tensor(t) else t, tree)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu")


def torch_device(backend: str, device: str | None) -> str:
    """`--device` for `--backend torch` (default cpu). With `--backend torchax` every JAX device is used,
    so a `--device` there would be silently ignored: an error instead."""
    if backend != "torch" and device is not None:
        raise UserError(f"--device applies to --backend torch; --backend {backend} uses every JAX device")
    return device or "cpu"


def torchax_runtime_on_all_devices(axis: str, compile_cache: bool):
    """Stage 1/3 `--backend torchax`: a TorchaxRuntime with every JAX device on mesh axis `axis`, and the
    CompileCache it compiles with. A host without JAX gets one error line naming the install."""
    try:
        import jax
    except ImportError as err:
        raise UserError(
            f"--backend torchax needs JAX and torchax ({err}); install them with "
            "pip install -e '.[tpu]' (or .[gpu], .[cpu]), or use --backend torch"
        ) from None
    cache = CompileCache(enabled=compile_cache)  # before torchax is imported (see CompileCache)
    import sharding
    from torchax_runtime import TorchaxRuntime

    return TorchaxRuntime(sharding.make_mesh(sharding.MeshShape(**{axis: jax.device_count()}))), cache


CHECKPOINT_FILE = "stage2_checkpoint.safetensors"


class DenoiseGuard:
    """Watches a denoising loop: NaN/Inf checks after every step, checkpoints every N steps and on SIGTERM,
    and the state to resume from.

    A checkpoint holds the loop's tensors (latents and any scheduler carry), the CPU generator's state
    and the next step index, plus a fingerprint of the request and the stage-1 file, so a checkpoint
    cannot be resumed into a different run. Written atomically; removed once the final latents are saved.
    """

    def __init__(self, directory: Path, fingerprint: dict[str, Any], every: int = 0, resume: bool = False) -> None:
        if every < 0:
            raise UserError(f"--checkpoint_every {every} must be >= 0")
        self.path = directory / CHECKPOINT_FILE
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        self.every = every
        self.stop_requested = False
        self.restored: tuple[int, dict[str, torch.Tensor]] | None = self._load() if resume else None

    def _load(self) -> tuple[int, dict[str, torch.Tensor]]:
        from safetensors import safe_open

        if not self.path.is_file():
            raise UserError(f"--resume: there is no checkpoint {self.path}")
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as err:  # safetensors raises several types for a damaged file
            raise UserError(f"--resume: {self.path} cannot be read ({err})") from None
        if metadata.get("fingerprint") != self.fingerprint:
            raise UserError(
                f"--resume: {self.path} belongs to a different request or stage-1 file; "
                "rerun without --resume to start over"
            )
        return int(metadata["next_step"]), tensors

    def install_stop_handler(self):
        """Within the block SIGTERM only sets a flag; the loop saves and stops after the current step."""
        import signal

        def request_stop(signum, frame):
            self.stop_requested = True

        @contextlib.contextmanager
        def handler():
            previous = signal.signal(signal.SIGTERM, request_stop)
            try:
                yield
            finally:
                signal.signal(signal.SIGTERM, previous)

        return handler()

    def save(self, next_step: int, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items() if t is not None}
        metadata = {"next_step": str(next_step), "fingerprint": self.fingerprint}
        _atomic_write(self.path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    def after_step(self, index: int, total: int, tensors: dict[str, torch.Tensor]) -> None:
        """Call with the loop state after step `index` (0-based) of `total`; `tensors["latents"]` is checked."""
        if not tensors["latents"].isfinite().all():
            raise UserError(f"step {index + 1} of {total} produced NaN or Inf latents; nothing was written")
        done = index + 1
        if self.stop_requested:
            self.save(done, tensors)
            raise Stopped(
                f"SIGTERM after step {done} of {total}; saved {self.path}. Continue with the same command plus --resume"
            )
        if self.every and done % self.every == 0 and done < total:
            self.save(done, tensors)

    def finished(self) -> None:
        self.path.unlink(missing_ok=True)
