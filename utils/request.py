"""The generation request: its flags, the typed `Request` every stage reads from the top level of
generation_config.json (checked field by field), later stages' overrides and the config they write, and the
checks that a later stage's inputs still belong to the request (the freshness checks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from utils.cli import UserError, finite_float, flag_names, parse_dtype
from utils.files import CONFIG_FILE, FORMAT_VERSION, write_config

# The generation request's keys that later stages may override from their command line.
REQUEST_KEYS = ("height", "width", "num_frames", "fps", "num_inference_steps")
REQUEST_KEYS += ("guidance_scale", "guidance_scale_2", "seed", "flow_shift", "scheduler")
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
