"""The stage files: names and format version, checked reads and atomic writes of safetensors files and
strict-JSON generation_config.json, and the output folder's ownership check."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from utils.cli import UserError, dtype_name

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


def check_output_dir(output_dir: Path, input_dir: Path, config: dict[str, Any]) -> None:
    """Refuse an output folder that holds another run's files (another model, family or stage-1 file than
    `config`, the input folder's): writing there would pair this run's config with that run's files."""
    if not output_dir.exists() or output_dir.resolve() == input_dir.resolve():
        return
    if not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a folder")
    free = next(f"{output_dir}-{n}" for n in range(2, 1000) if not Path(f"{output_dir}-{n}").exists())
    fix = f"write to an empty folder (e.g. --output_dir {free}) or leave --output_dir out to write beside the input"
    path = output_dir / CONFIG_FILE
    if not path.is_file():
        stray = [name for name in (STAGE1_FILE, STAGE2_FILE) if (output_dir / name).exists()]
        if stray:
            raise UserError(f"--output_dir {output_dir} holds {', '.join(stray)} without a {CONFIG_FILE}; {fix}")
        return
    try:
        theirs = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"--output_dir {output_dir}: its {CONFIG_FILE} is not valid JSON; {fix}") from None
    theirs = theirs if isinstance(theirs, dict) else {}
    stage1 = theirs.get("stage1") if isinstance(theirs.get("stage1"), dict) else {}
    differ = [key for key in ("model_family", "model_id") if theirs.get(key) != config.get(key)]
    if stage1.get("sha256") != config["stage1"]["sha256"]:
        differ.append("stage-1 embeddings")
    if differ:
        raise UserError(
            f"--output_dir {output_dir} holds another run's files ({', '.join(differ)} differ from "
            f"{input_dir}'s); {fix}"
        )


def ensure_writable_dir(directory: Path, files: tuple[str, ...] = ()) -> None:
    """Create the output folder, or fail with a user error before any heavy work (also where one of the
    `files` the stage will write is a folder: the rename at the end would fail after all the work)."""
    for name in (CONFIG_FILE, *files):
        if (directory / name).is_dir():
            raise UserError(f"{directory / name} is a folder; the stage writes a file there (move it away)")
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


RECORD_FIELDS = (("file", str), ("sha256", str), ("tensors", dict))  # what write_tensors records


def read_tensors(directory: Path, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load a stage file described by `record`, verifying its checksum, names, shapes and dtypes."""
    if not isinstance(record, dict) or not all(isinstance(record.get(key), kind) for key, kind in RECORD_FIELDS):
        raise UserError(
            f"{directory / CONFIG_FILE}: a stage file's record is not the file, sha256 and tensors a stage writes: "
            f"{json.dumps(record)[:120]} (edited by hand? rerun that stage)"
        )
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
    if needs and not isinstance(config[needs], dict):
        raise UserError(f"{path}: the {needs!r} section is {json.dumps(config[needs])}, not an object (rerun {needs})")
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


def stage_sections(config: dict[str, Any]) -> dict[str, Any]:
    """The per-stage sections of a config ("stage1", "stage2", ...), in order."""
    return {key: value for key, value in config.items() if key.startswith("stage")}


def stage2_normalization(stage2: dict[str, Any], vae_scaling_factor: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """How stage 2's latents are normalised: the recorded `latents_normalization`, or for a format_version 1
    section (the boolean `latents_scaled_by_vae_scaling_factor`, only ever true) the VAE's scaling factor."""
    normalization = stage2["latents_normalization"] if "latents_normalization" in stage2 else vae_scaling_factor()
    scaling = normalization.get("scaling_factor", 1.0) if isinstance(normalization, dict) else None
    if type(scaling) not in (int, float) or scaling <= 0:
        raise UserError(
            f"{CONFIG_FILE}: stage2.latents_normalization is {json.dumps(normalization)}; its scaling_factor must "
            "be a positive number (rerun stage 2)"
        )
    return normalization
