"""The stage-file contract every stage reads and writes, without JAX: file names and format version, checked
reads and atomic writes of safetensors files and strict-JSON generation_config.json, the output folder's
ownership check, and the generation request (its flags, the typed `Request` read from the config's top
level, later stages' overrides, and the freshness checks that a later stage's inputs still belong to it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpu_video.cli import UserError, dtype_name, folders, parse_dtype
from tpu_video.cli.options import KIND_TYPES, KIND_WORDS, Option

if TYPE_CHECKING:  # torch loads where tensors are read or written: the stages' parsers import this module
    import torch

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
    """Create the output folder and hold it to write (another run in it is an error: folders.hold), or fail
    with a user error before any heavy work (also where one of the `files` the stage will write is a folder:
    the rename at the end would fail after all the work)."""
    for name in (CONFIG_FILE, *files):
        if (directory / name).is_dir():
            raise UserError(f"{directory / name} is a folder; the stage writes a file there (move it away)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create output folder {directory}: {err.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise UserError(f"output folder {directory} is not writable")
    folders.hold(directory, write=True)  # one writer at a time, until the stage ends


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Save tensors (in their own dtype) atomically; return the config record describing the file."""
    from safetensors.torch import save_file

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
    from safetensors.torch import load_file

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


def sections_for_output(config: dict[str, Any], input_dir: Path, output_dir: Path) -> dict[str, Any]:
    """The sections a stage writing `output_dir` from `input_dir` (whose config is `config`) keeps beside its
    own: the input's, beside it; in another folder the input's stage 1 and that folder's own later sections
    (check_output_dir has checked they are this run's), never the input's, which name files it does not hold."""
    if output_dir.resolve() == input_dir.resolve():
        return stage_sections(config)
    return {"stage1": config["stage1"], **later_sections(output_dir)}


def later_sections(directory: Path) -> dict[str, Any]:
    """The stage 2/3 sections of the config already in `directory` (none without a readable one), which a
    stage writing there keeps but for those its new output makes stale (folders.without_stale_outputs)."""
    try:
        previous = read_config(directory)
    except UserError:
        return {}
    return {name: section for name, section in stage_sections(previous).items() if name != "stage1"}


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


# The generation request every family shares; later stages may override each from their command line.
REQUEST_OPTIONS = (
    Option("height", "int", "video height in pixels"),
    Option("width", "int", "video width in pixels"),
    Option("num_frames", "int", "frames (8n+1: CogVideoX, LTX-2; 4n+1: HunyuanVideo-1.5, Wan; LTX-2.5: its guess)"),
    Option("fps", "int", "frames per second of the mp4"),
    Option("num_inference_steps", "int", "denoising steps"),
    Option(
        "guidance_scale",
        "float",
        "classifier-free guidance scale (CogVideoX and Wan: <= 1 turns CFG off; HunyuanVideo-1.5: 1)",
    ),
    Option(
        "flow_shift",
        "float",
        "flow-matching timestep shift (HunyuanVideo-1.5: 5.0 at 480p, 9.0 at 720p; Wan: the model folder's "
        "scheduler value)",
    ),
    Option("seed", "int", "seed of the CPU generator that draws the initial noise (stage 1's default: 42)"),
)
REQUEST_KEYS = tuple(option.name for option in REQUEST_OPTIONS)
# Those that shape stage 2's latents (fps only matters to the mp4): a stage-2 section records them, and
# a later change to one of them makes that section stale. A family's options all count (Request.fingerprint).
DENOISE_KEYS = tuple(key for key in REQUEST_KEYS if key != "fps")
# Top-level keys older stage 1s wrote that nothing reads (CogVideoX's "variant"): dropped on read.
RETIRED_KEYS = ("variant",)
NOT_OPTIONS = ("format_version", *RETIRED_KEYS)


@dataclasses.dataclass(frozen=True)
class Request:
    """What was asked: the top-level keys of generation_config.json. Written by stage 1 (family defaults,
    then flags); later stages read it back and may override REQUEST_KEYS and the family's options, which is
    recorded. `options`: the family's own (its `OPTIONS` declare them; models.validate_request checks them),
    stored beside the shared keys; unset ones are absent."""

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
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        """The checks every family shares; geometry and options are each family's (models.validate_request).
        Types first: a hand-edited config may hold "64" or null where a number belongs."""
        for field in SHARED_FIELDS:
            value, (kind, _, optional) = getattr(self, field.name), field.type.partition(" | ")
            if not (value is None and optional) and (type(value) not in KIND_TYPES[kind]):
                raise UserError(
                    f"{field.name} is {json.dumps(value)} in the request; it must be {KIND_WORDS[kind]}"
                    + (" or null" if optional else "")
                )
        object.__setattr__(self, "options", {key: value for key, value in self.options.items() if value is not None})
        parse_dtype(self.dtype)
        if self.num_inference_steps < 1:
            raise UserError(f"--num_inference_steps {self.num_inference_steps} must be at least 1")
        if not 0 < self.fps <= 1000:
            raise UserError(f"--fps {self.fps} must be from 1 to 1000")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"--seed {self.seed} must be from 0 to 2**64 - 1 (the CPU generator's seeds)")

    def option(self, name: str) -> Any:
        """A family option's value, None where unset (the family's default then applies)."""
        return self.options.get(name)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> Request:
        """The request from flat keys (a config's top level, defaults and flags): shared fields by name, every
        other key a family option."""
        shared = {field.name for field in SHARED_FIELDS}
        options = {key: value for key, value in values.items() if key not in shared}
        return cls(**{key: value for key, value in values.items() if key in shared}, options=options)

    @classmethod
    def from_config(cls, config: dict[str, Any], path: Path | str = CONFIG_FILE) -> Request:
        """The request held at the top level of a generation_config.json (`path` names it in errors): every
        key but the format version, the stage sections and retired keys."""
        required = [field.name for field in SHARED_FIELDS if field.default is dataclasses.MISSING]
        missing = [name for name in required if name not in config]
        if missing:
            raise UserError(f"{path} lacks the request keys {missing}; rerun stage1_text_encoder.py")
        sections = stage_sections(config)
        return cls.from_values({key: value for key, value in config.items() if key not in (*NOT_OPTIONS, *sections)})

    def to_config(self) -> dict[str, Any]:
        """Top-level keys for generation_config.json (unset ones left out): the shared keys, then the options."""
        shared = {field.name: getattr(self, field.name) for field in SHARED_FIELDS}
        return {key: value for key, value in {**shared, **self.options}.items() if value is not None}

    def with_overrides(self, flags: dict[str, Any]) -> tuple[Request, dict[str, list]]:
        """The request with the given (non-None) flags applied (shared keys or options), and {key: [old, new]}
        for the record."""
        values = self.to_config()
        changes = {key: value for key, value in flags.items() if value is not None and values.get(key) != value}
        record = {key: [values.get(key), value] for key, value in changes.items()}
        return Request.from_values({**values, **changes}), record

    def fingerprint(self, stage1_only: Iterable[str] = ()) -> dict[str, Any]:
        """What stage 2's latents depend on (besides the stage-1 file): recorded in its section and in
        checkpoints, so stale latents and foreign checkpoints are recognised. Unset keys are left out (an
        older stage 2 recorded them as null: the readers take null as unset), and so are the family's
        `stage1_only` options (the stage-1 file's sha256 covers them; an older stage 2 did not record them)."""
        values = {**{key: getattr(self, key) for key in DENOISE_KEYS}, **self.options}
        kept = {key: value for key, value in values.items() if value is not None and key not in stage1_only}
        return {"model_id": self.model_id, **kept}


SHARED_FIELDS = tuple(field for field in dataclasses.fields(Request) if field.name != "options")


def earlier_overrides(config: dict[str, Any], request: Request, overrides: dict[str, list]) -> dict[str, list]:
    """What the folder's request holds from an earlier stage's overrides (they stay until overridden again):
    {key: [stage 1's value, the value this run keeps]}, beside this run's own `overrides`. Empty for folders
    whose stage 1 did not record its request."""
    written = config["stage1"].get("request")
    if not isinstance(written, dict):
        return {}
    now = request.to_config()
    keys = [key for key in {**written, **now} if key not in overrides]
    return {key: [written.get(key), now.get(key)] for key in keys if written.get(key) != now.get(key)}


def describe_folder(directory: Path, config: dict[str, Any]) -> str:
    """One line naming a stage folder and what it holds, logged as a later stage starts reading it (a default
    `--input_dir` that holds an older run is then seen at once)."""
    written = time.strftime("%Y-%m-%d %H:%M", time.localtime((directory / CONFIG_FILE).stat().st_mtime))
    prompt = str(config.get("prompt", ""))
    prompt = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    done = list(stage_sections(config))
    return (
        f"reading {directory}: {config.get('model_family')} {config.get('model_id')}, prompt {json.dumps(prompt)}, "
        f"{' and '.join(done) or 'no stage'} written by {written}"
    )


def write_stage_config(
    directory: Path, request: Request, sections: dict[str, Any], stage: str, section: dict[str, Any]
) -> None:
    """generation_config.json with the request on top, the other stages' `sections` kept (but for the later
    stages' outputs that `stage`'s new output makes stale: `folders.without_stale_outputs`), and `stage`'s section
    (new or replaced) last."""
    others = {name: value for name, value in sections.items() if name != stage}
    others = folders.without_stale_outputs(directory, others, stage, section.get("sha256"))
    write_config(directory, {"format_version": FORMAT_VERSION, **request.to_config(), **others, stage: section})


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


def fingerprint_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys in which two request fingerprints differ, a key null in one and absent from the other being
    equal (an older stage 2 recorded unset keys as null)."""
    return [key for key in {**recorded, **now} if recorded.get(key) != now.get(key)]


def check_stage2_fresh(
    directory: Path, config: dict[str, Any], request: Request, stage1_only: Iterable[str] = ()
) -> None:
    """Refuse stage 2 latents made from another stage-1 file or another request than the folder's now
    (`stage1_only`: the family's options only stage 1 acts on, as Request.fingerprint takes them)."""
    stage2 = config["stage2"]
    recorded = stage2.get("request", {})
    changed = fingerprint_changes(recorded if isinstance(recorded, dict) else {}, request.fingerprint(stage1_only))
    if stage2.get("stage1_sha256") != config["stage1"]["sha256"]:
        changed.insert(0, "embeddings")
    if changed:
        raise UserError(
            f"{directory / CONFIG_FILE}: the stage2 section is stale, stage 1 was rerun since "
            f"({', '.join(changed)} changed); rerun stage 2"
        )
    if "latents_normalization" not in stage2 and not stage2.get("latents_scaled_by_vae_scaling_factor"):
        raise UserError(f"{directory}: stage 2 did not record the latents' normalisation; rerun stage 2")
