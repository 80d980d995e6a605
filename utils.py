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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tpu_video.cli import UserError, dtype_name, finite_float, flag_names, parse_dtype

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


# The generation request's keys that later stages may override from their command line.
REQUEST_KEYS = ("height", "width", "num_frames", "fps", "num_inference_steps")
REQUEST_KEYS += ("guidance_scale", "guidance_scale_2", "seed", "flow_shift", "scheduler")
# LTX-2's guidance terms and motion speed (diffusers' LTX2Pipeline arguments); unset, the pipeline's defaults.
LTX2_GUIDANCE_KEYS = ("stg_scale", "stg_blocks", "modality_scale", "guidance_rescale", "audio_guidance_scale")
LTX2_GUIDANCE_KEYS += ("audio_stg_scale", "audio_modality_scale", "audio_guidance_rescale", "motion_speed")
REQUEST_KEYS += LTX2_GUIDANCE_KEYS
# --scheduler's names for the flow-matching samplers a Wan folder's scheduler config can build.
SCHEDULERS = ("unipc", "euler")
# Those that shape stage 2's latents (fps only matters to the mp4): a stage-2 section records them, and
# a later change to one of them makes that section stale.
DENOISE_KEYS = tuple(key for key in REQUEST_KEYS if key != "fps")


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
        "--scheduler",
        choices=SCHEDULERS,
        help="Wan: the sampler, built from the model folder's scheduler config (default: the folder's, UniPC in "
        "the published ones; the 4-step distillation LoRAs expect euler, docs/lora.md)",
    )
    group.add_argument(
        "--seed",
        type=int,
        help="seed of the CPU generator that draws the initial noise" + ("" if for_later_stage else " (default: 42)"),
    )
    add_ltx2_guidance_arguments(parser)


def add_ltx2_guidance_arguments(parser) -> None:
    """LTX-2's guidance flags (docs/ltx2.md), named as LTX2Pipeline's arguments. Unset, a term takes the
    pipeline's default and is skipped where it cannot act; a value given that cannot act is an error."""
    group = parser.add_argument_group("LTX-2 guidance", "(unset: LTX2Pipeline's defaults; other families refuse them)")
    for name, words in (
        ("stg_scale", "spatio-temporal guidance scale (default 1.0; acts on models with perturbed attention)"),
        ("modality_scale", "modality guidance scale (default 3.0; > 1 runs the pass without audio<->video attention)"),
        ("guidance_rescale", "rescale of the guided prediction toward the conditional one's std (default 0.7)"),
        ("audio_guidance_scale", "the audio stream's --guidance_scale (default 7.0; 0 means 0)"),
        ("audio_stg_scale", "the audio stream's --stg_scale (default 1.0)"),
        ("audio_modality_scale", "the audio stream's --modality_scale (default 3.0)"),
        ("audio_guidance_rescale", "the audio stream's --guidance_rescale (default 0.7)"),
        ("motion_speed", "motion relative to real time: RoPE sees fps / motion_speed (default 1.0)"),
    ):
        group.add_argument(f"--{name}", type=finite_float, help=words)
    group.add_argument(
        "--stg_blocks",
        help="comma-separated transformer blocks whose self-attention the STG pass perturbs (default: 28)",
    )


# What each annotation of Request accepts (bool is not a number here, though Python's int says so).
FIELD_TYPES = {"str": (str,), "int": (int,), "float": (int, float)}
FIELD_KINDS = {"str": "a string", "int": "an integer", "float": "a number"}


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
    scheduler: str | None = None  # Wan: one of SCHEDULERS (None: the model folder's)
    # LTX-2 (None: LTX2Pipeline's default, tpu_video/models/ltx2/guidance.py)
    stg_scale: float | None = None
    stg_blocks: str | None = None  # comma-separated block indices
    modality_scale: float | None = None
    guidance_rescale: float | None = None
    audio_guidance_scale: float | None = None
    audio_stg_scale: float | None = None
    audio_modality_scale: float | None = None
    audio_guidance_rescale: float | None = None
    motion_speed: float | None = None
    image_crf: int | None = None  # LTX-2 image-to-video: stage 1's H.264 re-encode of the image (0: none)

    def __post_init__(self) -> None:
        """The checks every family shares; geometry and family extras are each family's validate_request.
        Types first: a hand-edited config may hold "64" or null where a number belongs."""
        for field in dataclasses.fields(self):
            value, (kind, _, optional) = getattr(self, field.name), field.type.partition(" | ")
            if not (value is None and optional) and (type(value) not in FIELD_TYPES[kind]):
                raise UserError(
                    f"{field.name} is {json.dumps(value)} in the request; it must be {FIELD_KINDS[kind]}"
                    + (" or null" if optional else "")
                )
        parse_dtype(self.dtype)
        if self.num_inference_steps < 1:
            raise UserError(f"--num_inference_steps {self.num_inference_steps} must be at least 1")
        if not 0 < self.fps <= 1000:
            raise UserError(f"--fps {self.fps} must be from 1 to 1000")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise UserError(f"--scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"--seed {self.seed} must be from 0 to 2**64 - 1 (the CPU generator's seeds)")

    @classmethod
    def from_flags(cls, args, *, model_family: str, model_id: str, defaults: dict[str, Any]) -> Request:
        """Stage 1: the family's defaults, then every request flag given on the command line."""
        values = {**defaults, "model_family": model_family, "model_id": model_id}
        values.update(prompt=args.prompt, negative_prompt=args.negative_prompt, dtype=args.dtype)
        given = {key: getattr(args, key, None) for key in (*REQUEST_KEYS, "image_crf")}  # image_crf: stage 1 only
        return cls(**{**values, **{key: value for key, value in given.items() if value is not None}})

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
