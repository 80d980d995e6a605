"""Stage 1's media inputs: the files a family conditions on besides the prompt (images today; videos, masks
and reference images next). A family declares each as a `MediaInput` (its flag, its reader, the task a run
with it is); here they are checked against what the model takes, read before any weights load, hashed and
recorded in the stage-1 section (`inputs`), and stage 2 checks that the geometry they were encoded for is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError, log
from utils import sha256_file

from .images import read_image
from .videos import read_video, video_digest

GEOMETRY = ("height", "width", "num_frames")  # what stage 1 encodes an input for


@dataclass(frozen=True)
class MediaInput:
    """One input file: `--NAME PATH` in stage 1 and the key NAME of a --prompts entry. `read(path, flag)`
    gives what the family encodes and the notes its record keeps (besides the file name and sha256), or one
    UserError naming the file. `task`: stage 1's recorded task when it is given. `missing`: the error when a
    model that requires it is not given it."""

    name: str
    help: str
    read: Callable[[str, str], tuple[Any, dict[str, Any]]]
    kind: str = "image"  # the words of "takes no <kind> (a text-to-video model)"
    task: str = "i2v"
    required: bool = False
    missing: str = ""
    frame_step: int = 1  # a video input: the model takes frame_step x n + 1 of its frames (the VAE's rule)
    many: bool = False  # one or more files (`--NAME PATH [PATH ...]`): read one by one, given as a list
    timed: bool = False  # its checks and encode take the video's length (a video, frames placed in time)

    def required_here(self) -> MediaInput:
        """This input as one a model requires (a family's media_inputs(source) for an i2v checkpoint)."""
        return replace(self, required=True)


def read_image_input(path: str, flag: str) -> tuple[Any, dict[str, Any]]:
    """The image reader of an image input: the picture as diffusers' load_image sees it, and its size
    ([height, width], after the EXIF orientation) first among the notes."""
    image, notes = read_image(path, flag)
    width, height = image.size
    return image, {"size": [height, width], **notes}


def image_input(name: str, help: str, missing: str = "", task: str = "i2v", many: bool = False) -> MediaInput:
    return MediaInput(name, help, read_image_input, missing=missing, task=task, many=many)


def video_input(name: str, help: str, task: str = "v2v", frame_step: int = 1) -> MediaInput:
    """A video input: its frames (PIL images) and {frames, size, fps} among the notes (videos.read_video)."""
    return MediaInput(name, help, read_video, kind="video", task=task, frame_step=frame_step, timed=True)


def frames_from_inputs(
    accepted: tuple[MediaInput, ...], records: Mapping[str, dict[str, Any]], given: int | None
) -> int | None:
    """The frame count a video input sets where --num_frames is not given: as many as the model takes of it
    (frame_step x n + 1: the VAE encodes those and no more, so the pipeline's video makes the same; the rest
    is said). A given count longer than the video is refused (a shorter one takes its first frames)."""
    steps = {media.name: media.frame_step for media in accepted}
    counts = [(name, record["frames"]) for name, record in records.items() if record["kind"] == "video"]
    if not counts:
        return None
    name, frames = counts[0]
    if given is not None and given > frames:
        raise UserError(f"--num_frames {given}: --{name} has {frames} frames; give at most {frames}, or leave it out")
    if given is not None:
        return None
    step = steps.get(name, 1)
    usable = (frames - 1) // step * step + 1
    if usable != frames:
        log(f"--{name}: {frames} frames; the model takes {step}n+1, so its first {usable} (--num_frames {usable})")
    return usable


def check_given(
    model: str, accepted: tuple[MediaInput, ...], given: Mapping[str, str | None], declared: Mapping[str, MediaInput]
) -> None:
    """Before any weights load: the inputs given (by name; `declared`: every family's declaration of each) against
    those `model` takes (`accepted`, required ones marked)."""
    names = {media.name for media in accepted}
    text_only = not [media for media in accepted if media.task == "i2v"]
    for name, path in given.items():
        if path is not None and name not in names:
            kind = declared[name].kind
            what = f"takes no {kind} (a text-to-video model)" if text_only and kind == "image" else f"takes no --{name}"
            takes = ", ".join(f"--{media.name}" for media in accepted)
            raise UserError(f"--{name}: --model {model!r} {what}" + (f"; it takes {takes}" if takes else ""))
    for media in accepted:
        if media.required and given.get(media.name) is None:
            raise UserError(f"--model {model!r} {media.missing or f'needs --{media.name} PATH ({media.help})'}")


def read_inputs(
    accepted: tuple[MediaInput, ...], given: Mapping[str, str | None]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The given inputs by name, and their records for the stage-1 section."""
    values, records = {}, {}
    for media in accepted:
        path = given.get(media.name)
        if path is None:
            continue
        if not media.many:
            if not isinstance(path, str):
                raise UserError(f"--{media.name} takes one path, not {len(path)}")
            values[media.name], records[media.name] = _read_one(media, path)
            continue
        paths = [path] if isinstance(path, str) else path
        if not paths:
            raise UserError(f"--{media.name} takes one path or more, not none")
        read = [_read_one(media, one) for one in paths]
        values[media.name] = [value for value, _ in read]
        records[media.name] = {"kind": media.kind, "items": [record for _, record in read]}
    return values, records


def _read_one(media: MediaInput, path: str) -> tuple[Any, dict[str, Any]]:
    value, notes = media.read(path, media.name)
    digest = video_digest(Path(path)) if Path(path).is_dir() else sha256_file(Path(path))
    return value, {"kind": media.kind, "file": Path(path).name, "sha256": digest, **notes}


def record_processed_size(records: dict[str, dict[str, Any]], height: int, width: int) -> None:
    """Add the size the images were encoded at to their records, and say where that changed their shape (the
    config alone said it)."""
    for name, record in records.items():
        if record["kind"] not in ("image", "video") or "size" not in record:  # another kind may give no size
            continue
        record["processed_size"] = [height, width]
        (from_height, from_width) = record["size"]
        theirs, ours = from_width / from_height, width / height
        if abs(theirs - ours) > 0.01 * ours:
            log(
                f"--{name}: the {from_height}x{from_width} {record['kind']} (height x width) is fitted to the "
                f"requested {height}x{width} (--height x --width), another aspect ratio ({theirs:.2f} against "
                f"{ours:.2f}): the pipeline's processor stretches or crops it"
            )


def task_of(accepted: tuple[MediaInput, ...], values: Mapping[str, Any]) -> str:
    """Stage 1's recorded task: the first given input's, "t2v" with none."""
    return next((media.task for media in accepted if media.name in values), "t2v")


def check_geometry_kept(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Stage 2 of a run with media inputs: stage 1 encoded them at the request's size and frame count; later
    stages cannot change them."""
    changed = [key for key in GEOMETRY if key in overrides]
    if config["stage1"].get("task", "t2v") != "t2v" and changed:
        what = "the image" if config["stage1"].get("task") == "i2v" else "its inputs"
        raise UserError(
            f"--{changed[0]}: stage 1 encoded {what} for {config['height']}x{config['width']}, "
            f"{config['num_frames']} frames; rerun stage 1 to change the size or frame count"
        )
