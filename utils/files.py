"""The stage files: names and format version, checked reads and atomic writes of safetensors files and
strict-JSON generation_config.json, the checks that a later stage's inputs still belong together."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from utils.cli import UserError, dtype_name

if TYPE_CHECKING:
    from utils.request import Request

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
