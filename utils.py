"""The stage-file contract and the CLI conventions around it.

File names and format version; checked reads and atomic writes of safetensors files and strict-JSON
generation_config.json; the request (`Request`) with its overrides and staleness checks; `UserError`/`run_cli`
(one `error:` line, exit 2) and logging. Imported by all three stages and `models`: it never imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# 2: stage 2 records `latents_normalization` (1 had the boolean `latents_scaled_by_vae_scaling_factor`,
# which stage 3 still reads: see stage2_normalization).
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
CONFIG_FILE = "generation_config.json"
STAGE1_FILE = "stage1_embeddings.safetensors"
STAGE2_FILE = "stage2_latents.safetensors"
VIDEO_FILE = "output_video.mp4"
CHECKPOINT_FILE = "stage2_checkpoint.safetensors"
DEFAULT_OUTPUT_DIR = "./stage_outputs"

# The generation request's keys that later stages may override from their command line.
REQUEST_KEYS = ("height", "width", "num_frames", "fps", "num_inference_steps")
REQUEST_KEYS += ("guidance_scale", "guidance_scale_2", "seed", "flow_shift")
# Those that shape stage 2's latents (fps only matters to the mp4): a stage-2 section records them, and
# a later change to one of them makes that section stale.
DENOISE_KEYS = tuple(key for key in REQUEST_KEYS if key != "fps")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
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


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's main(): user errors become one `error:` line and exit status 2; a requested stop one
    `stopped:` line and status 143 (130 after Ctrl-C); bugs keep their traceback."""
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Stopped as stop:
        print(f"stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(STOPPED_EXIT_STATUS)
    except KeyboardInterrupt:  # writes are atomic, so nothing partial is left
        print("\nstopped: interrupted (Ctrl-C); no partial file was written", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_STATUS)


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


def parse_dtype(name: str) -> torch.dtype:
    """`--dtype` as a torch dtype."""
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)} (or {', '.join(DTYPE_SPELLINGS)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
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
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
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
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not an object (was it edited by hand?)")
    if bad := non_finite_keys(config):
        raise UserError(f"{path}: {', '.join(bad)} is NaN or infinite; strict JSON and the request need finite numbers")
    version = config.get("format_version")
    if version is None and any((directory / name).is_file() for name in (STAGE1_FILE, STAGE2_FILE)):
        raise UserError(reference_folder_message(directory, config))
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UserError(
            f"{path} was written by a newer version of this tool (format_version {version}, this one reads "
            f"{FORMAT_VERSION}); upgrade to read it"
        )
    if version not in READABLE_FORMAT_VERSIONS:
        raise UserError(
            f"{path} has format_version {version!r}; this tool reads format_version "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))} (a folder from another tool? rerun stage 1 here)"
        )
    if needs and needs not in config:
        raise UserError(f"{path} has no {needs!r} section (run the {needs} script first)")
    return config


def reference_folder_message(directory: Path, config: dict[str, Any]) -> str:
    """What to say about a folder the reference scripts wrote: their file names, no format_version and
    no checksums, so nothing in it can be verified; stage 1 is the stage to redo here."""
    model = config.get("model_id") or config.get("model")
    prompt = config.get("prompt")
    command = ["python stage1_text_encoder.py"]
    command += [f"--model {model}"] if model else ["--model <the model>"]
    command += [f"--prompt {json.dumps(prompt)}"] if isinstance(prompt, str) else ['--prompt "..."']
    command += [f"--output_dir {directory}"]
    return (
        f"{directory} looks like a stage folder from the reference scripts ({CONFIG_FILE} has no "
        "format_version and its files no sha256), which this tool cannot verify; redo stage 1 here: "
        + " ".join(command)
    )


def non_finite_keys(value: Any, where: str = "") -> list[str]:
    """Dotted paths of the NaN or infinite numbers inside a parsed JSON value (Python's json reads
    NaN/Infinity, which strict JSON has not)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [where or "(top level)"]
    if isinstance(value, dict):
        return [key for name, item in value.items() for key in non_finite_keys(item, f"{where}.{name}".lstrip("."))]
    if isinstance(value, list):
        return [key for index, item in enumerate(value) for key in non_finite_keys(item, f"{where}[{index}]")]
    return []


def strict_json(value: Any, **kwargs) -> str:
    """json.dumps refusing NaN and Infinity, so every file we write is strict JSON."""
    return json.dumps(value, allow_nan=False, **kwargs)


def write_config(directory: Path, config: dict[str, Any]) -> None:
    text = strict_json(config, indent=2, sort_keys=False) + "\n"
    atomic_write(directory / CONFIG_FILE, lambda tmp: tmp.write_text(text))


def add_request_arguments(parser, *, for_later_stage: bool) -> None:
    """The generation-request flags. In stage 1 an omitted flag takes the family default; in a later
    stage it keeps the value from generation_config.json (and a given one is recorded as an override)."""
    where = "default: from generation_config.json" if for_later_stage else "default: the model family's"
    group = parser.add_argument_group("generation request", f"({where})")
    group.add_argument("--height", type=int, help="video height in pixels")
    group.add_argument("--width", type=int, help="video width in pixels")
    group.add_argument(
        *flag_names("--num_frames"),
        dest="num_frames",
        type=int,
        help="number of frames (8n+1 for CogVideoX, 4n+1 for HunyuanVideo-1.5 and Wan)",
    )
    group.add_argument("--fps", type=int, help="frames per second of the mp4")
    group.add_argument("--num_inference_steps", type=int, help="denoising steps")
    group.add_argument(
        "--guidance_scale",
        type=finite_float,
        help="classifier-free guidance scale (CogVideoX and Wan: <= 1 turns CFG off; HunyuanVideo-1.5: 1)",
    )
    group.add_argument(
        "--guidance_scale_2",
        type=finite_float,
        help="Wan 2.2 A14B: guidance scale of the low-noise expert (default: --guidance_scale)",
    )
    group.add_argument(
        "--flow_shift",
        type=finite_float,
        help="flow-matching timestep shift (HunyuanVideo-1.5: 5.0 at 480p, 9.0 at 720p; Wan: the model "
        "folder's scheduler value)",
    )
    group.add_argument(
        "--seed",
        type=int,
        help="seed of the CPU generator that draws the initial noise" + ("" if for_later_stage else " (default: 42)"),
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """What was asked: the top-level keys of generation_config.json. Written by stage 1 (family defaults,
    then flags); later stages read it back and may override REQUEST_KEYS, which is recorded."""

    model_family: str
    model_id: str
    prompt: str
    negative_prompt: str
    dtype: str
    height: int
    width: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    flow_shift: float | None = None  # flow-matching families
    guidance_scale_2: float | None = None  # Wan 2.2's low-noise expert (None: guidance_scale)
    variant: str | None = None  # e.g. CogVideoX "1.0" or "1.5"

    def __post_init__(self) -> None:
        """The checks every family shares; geometry and family extras are each family's validate_request."""
        parse_dtype(self.dtype)
        if self.num_inference_steps < 1:
            raise UserError(f"--num_inference_steps {self.num_inference_steps} must be at least 1")
        for key in ("guidance_scale", "guidance_scale_2"):
            if (getattr(self, key) or 0) < 0:
                raise UserError(f"--{key} {getattr(self, key)} must not be negative")
        if not 0 < self.fps <= 1000:
            raise UserError(f"--fps {self.fps} must be from 1 to 1000")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"--seed {self.seed} must be from 0 to 2**64 - 1 (the CPU generator's seeds)")

    @classmethod
    def from_flags(cls, args, *, model_family: str, model_id: str, defaults: dict[str, Any]) -> Request:
        """Stage 1: the family's defaults, then every request flag given on the command line."""
        values = {**defaults, "model_family": model_family, "model_id": model_id}
        values.update(prompt=args.prompt, negative_prompt=args.negative_prompt, dtype=args.dtype)
        values.update({key: getattr(args, key) for key in REQUEST_KEYS if getattr(args, key) is not None})
        return cls(**values)

    @classmethod
    def from_config(cls, config: dict[str, Any], path: Path | str = CONFIG_FILE) -> Request:
        """The request held at the top level of a generation_config.json (`path` names it in errors)."""
        fields = {field.name: field for field in dataclasses.fields(cls)}
        required = [name for name, field in fields.items() if field.default is dataclasses.MISSING]
        missing = [name for name in required if name not in config]
        if missing:
            raise UserError(f"{path} lacks the request keys {missing}; rerun stage1_text_encoder.py")
        return cls(**{name: config[name] for name in fields if name in config})

    def to_config(self) -> dict[str, Any]:
        """Top-level keys for generation_config.json (unset family extras left out)."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    def with_overrides(self, flags: dict[str, Any]) -> tuple[Request, dict[str, list]]:
        """The request with the given (non-None) flags applied, and {key: [old, new]} for the record."""
        changes = {key: value for key, value in flags.items() if value is not None and getattr(self, key) != value}
        record = {key: [getattr(self, key), value] for key, value in changes.items()}
        return dataclasses.replace(self, **changes), record

    def fingerprint(self) -> dict[str, Any]:
        """What stage 2's latents depend on (besides the stage-1 file): recorded in its section and in
        checkpoints, so stale latents and foreign checkpoints are recognised."""
        return {"model_id": self.model_id, **{key: getattr(self, key) for key in DENOISE_KEYS}}


def request_flags(args) -> dict[str, Any]:
    """The request flags given on a later stage's command line (None where omitted)."""
    return {key: getattr(args, key, None) for key in REQUEST_KEYS}


def write_stage_config(
    directory: Path, request: Request, sections: dict[str, Any], stage: str, section: dict[str, Any]
) -> None:
    """generation_config.json with the request on top, the other stages' `sections` kept, and `stage`'s
    section (new or replaced) last."""
    others = {name: value for name, value in sections.items() if name != stage}
    write_config(directory, {"format_version": FORMAT_VERSION, **request.to_config(), **others, stage: section})


def stage_sections(config: dict[str, Any]) -> dict[str, Any]:
    """The per-stage sections of a config ("stage1", "stage2", ...), in order."""
    return {key: value for key, value in config.items() if key.startswith("stage")}


def check_stage1_fresh(directory: Path, config: dict[str, Any], request: Request) -> None:
    """Refuse stage-1 embeddings whose prompts are not the request's (a hand-edited config). Folders from
    before stage 1 recorded them (no "prompts" key) are taken as they are."""
    encoded = config["stage1"].get("prompts")
    asked = {"prompt": request.prompt, "negative_prompt": request.negative_prompt}
    if encoded is not None and encoded != asked:
        changed = [key for key in asked if encoded.get(key) != asked[key]]
        raise UserError(
            f"{directory / CONFIG_FILE}: {', '.join(changed)} differs from what stage 1 encoded; rerun stage 1 "
            "to change the prompt"
        )


def check_stage2_fresh(directory: Path, config: dict[str, Any], request: Request) -> None:
    """Refuse stage 2 latents made from another stage-1 file or another request than the folder's now."""
    stage2 = config["stage2"]
    recorded = stage2.get("request", {})
    changed = [key for key, value in request.fingerprint().items() if key in recorded and recorded[key] != value]
    if stage2.get("stage1_sha256") != config["stage1"]["sha256"]:
        changed.insert(0, "embeddings")
    if changed:
        raise UserError(
            f"{directory / CONFIG_FILE}: the stage2 section is stale, stage 1 was rerun since "
            f"({', '.join(changed)} changed); rerun stage 2"
        )
    if "latents_normalization" not in stage2 and not stage2.get("latents_scaled_by_vae_scaling_factor"):
        raise UserError(f"{directory}: stage 2 did not record the latents' normalisation; rerun stage 2")


def stage2_normalization(stage2: dict[str, Any], vae_scaling_factor: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """How stage 2's latents are normalised: the recorded `latents_normalization`, or for a format_version 1
    section (the boolean `latents_scaled_by_vae_scaling_factor`, only ever true) the VAE's scaling factor."""
    if "latents_normalization" in stage2:
        return stage2["latents_normalization"]
    return vae_scaling_factor()
