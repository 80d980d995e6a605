"""Many videos per run: stage 1's prompt lists (`--prompts FILE`, `--seeds`), the `batch.json` index it
writes beside one ordinary stage folder per entry, and the folder lists later stages read from it.

A list entry is what one stage-1 run's flags say: its prompt, and optionally its own negative prompt,
seed, folder name and media inputs (image, last image, ...: the families' media-input names); anything it
leaves out comes from the command's flags. Every entry is checked before any weights load, and a bad one
is one `error:` naming its line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from utils import CHECKPOINT_FILE, CONFIG_FILE, STAGE2_FILE, atomic_write, read_config

BATCH_FILE = "batch.json"
BATCH_FORMAT = 1
ENTRY_FIELDS = ("prompt", "negative_prompt", "seed", "name")  # and the media inputs' names
MAX_VIDEOS = 10_000  # per run, from --seeds or --prompts: a typo should not plan a million folders
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range (utils.Request checks a single --seed alike)
NAME_BYTES = 255  # NAME_MAX: the longest file name Linux file systems take


@dataclasses.dataclass(frozen=True)
class Entry:
    """One video of a list: the flags it sets (None: the command's), where it came from (for errors)."""

    where: str
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    name: str | None = None
    inputs: dict[str, str | list[str]] = dataclasses.field(default_factory=dict)  # media inputs' paths by name

    def flags(self) -> dict[str, Any]:
        """The stage-1 flags this entry sets."""
        fields = ("prompt", "negative_prompt", "seed")
        return {**{key: getattr(self, key) for key in fields if getattr(self, key) is not None}, **self.inputs}


def parse_seeds(text: str) -> list[int]:
    """`--seeds 1,2,5-8` as [1, 2, 5, 6, 7, 8]; one `error:` for anything else, bounds and count checked
    before a range is expanded."""
    ranges: list[range] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise UserError(f"--seeds {text!r}: {part.strip()!r} is not a seed or a range like 5-8") from None
        if last < first:
            raise UserError(f"--seeds {text!r}: the range {part.strip()} runs backwards")
        if last > MAX_SEED:
            raise UserError(f"--seeds {text!r}: {last} is past the largest seed, {MAX_SEED} (2**64 - 1)")
        ranges.append(range(first, last + 1))
    count = sum(seeds.stop - seeds.start for seeds in ranges)  # len() of a range overflows past 2**63
    if count > MAX_VIDEOS:
        raise UserError(f"--seeds {text!r} asks for {count} videos; a run makes at most {MAX_VIDEOS}")
    seeds = [seed for seeds in ranges for seed in seeds]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: a seed appears twice")
    return seeds


def _json_entry(text: str, where: str, base: Path, input_names: tuple[str, ...]) -> Entry:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not a JSON object ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: not a JSON object")
    known = (*ENTRY_FIELDS, *input_names)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    for key in ("prompt", "negative_prompt", "name"):
        if key in value and not isinstance(value[key], str):
            raise UserError(f"{where}: {key!r} must be a string")
    for key in input_names:  # a path, or a list of them (an input taking several files)
        paths = value.get(key, "")
        if not isinstance(paths, str) and not (
            isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)
        ):
            raise UserError(f"{where}: {key!r} must be a path (a string) or a list of paths (not empty)")
    seed = value.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise UserError(f"{where}: 'seed' must be an integer, not {seed!r}")
    inputs = {
        key: str(base / value[key]) if isinstance(value[key], str) else [str(base / path) for path in value[key]]
        for key in input_names
        if key in value
    }
    return Entry(where, value.get("prompt", ""), value.get("negative_prompt"), seed, value.get("name"), inputs)


def read_prompt_list(path: Path, input_names: tuple[str, ...] = ()) -> list[Entry]:
    """Plain text (one prompt per line) or JSON Lines (one object per line, `ENTRY_FIELDS` and the media
    inputs' `input_names`); blank lines and lines starting with `#` are skipped. Input paths are relative to
    the list's folder. Lines end at `\n`
    alone (a `\r` before it is a Windows editor's): `str.splitlines` would also split at U+2028, form
    feeds and the like, which may sit inside a prompt. A UTF-8 byte-order mark is not part of the text."""
    try:
        lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8-sig").split("\n")]
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--prompts {path}: cannot read it ({err})") from None
    numbered = [
        (n, line.strip()) for n, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")
    ]
    if len(numbered) > MAX_VIDEOS:
        raise UserError(f"--prompts {path} lists {len(numbered)} videos; a run makes at most {MAX_VIDEOS}")
    json_lines = path.suffix == ".jsonl" or (numbered and numbered[0][1].startswith("{"))
    entries = []
    for number, line in numbered:
        where = f"--prompts {path} line {number}"
        entries.append(_json_entry(line, where, path.parent, input_names) if json_lines else Entry(where, line))
    if not entries:
        raise UserError(f"--prompts {path}: no prompts in it (blank lines and # comments are skipped)")
    return entries


def entries_from_flags(
    prompt: str | None, prompts: str | None, seed: int | None, seeds: str | None, input_names: tuple[str, ...]
) -> list[Entry] | None:
    """The videos `--prompts`/`--seeds` ask for (the four flags' values), checked (a list entry may set the
    media inputs `input_names`); None for a single run (`--prompt` alone)."""
    if prompts is not None and prompt is not None:
        raise UserError("--prompt and --prompts: give one prompt or a list, not both")
    if prompts is None and prompt is None:
        raise UserError("the prompt is missing: give --prompt TEXT, or --prompts FILE for a list")
    if seeds is not None and seed is not None:
        raise UserError("--seed and --seeds: give one seed or a sweep, not both")
    if prompts is None:
        if seeds is None:
            return None
        return [Entry(f"--seeds {seeds}", prompt, seed=number) for number in parse_seeds(seeds)]
    if seeds is not None:
        raise UserError("--seeds sweeps one --prompt; in a --prompts list give each entry its own seed (JSON Lines)")
    entries = read_prompt_list(Path(prompts), input_names)
    for entry in entries:
        if not entry.prompt.strip():
            raise UserError(f"{entry.where}: the prompt is empty")
        for key, paths in entry.inputs.items():
            for path in [paths] if isinstance(paths, str) else paths:
                if not Path(path).exists():  # a file, or a folder of frames (a video input)
                    raise UserError(f"{entry.where}: {key} {path} is not a file or folder")
    return entries


def folder_names(entries: list[Entry]) -> list[str]:
    """Each entry's folder under --output_dir: its `name`, else its zero-padded index; names unique and ones
    the file system takes, all checked before any folder is made."""
    width = max(3, len(str(len(entries) - 1)))
    names, seen = [], {}
    for index, entry in enumerate(entries):
        name = entry.name if entry.name is not None else f"{index:0{width}d}"
        problem = _name_problem(name)
        if problem:
            raise UserError(f"{entry.where}: name {name[:60]!r} cannot be a folder name: {problem}")
        if name in seen:
            raise UserError(f"{entry.where}: name {name!r} is already used by {seen[name]}")
        seen[name] = entry.where
        names.append(name)
    return names


def _name_problem(name: str) -> str | None:
    if not name or name in (".", "..") or name == BATCH_FILE:
        return "it is empty, a dot name or the batch index's"
    if any(char in "/\\" or ord(char) < 32 or ord(char) == 127 for char in name):
        return "it holds a slash, a NUL or another control character"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it holds a lone surrogate (\\ud800-\\udfff), which no file name can"
    if size > NAME_BYTES:
        return f"it is {size} bytes in UTF-8; a folder name holds at most {NAME_BYTES}"
    return None


def check_output_kind(output_dir: Path, many: bool) -> None:
    """A batch folder holds stage folders and batch.json, a stage folder its own files: writing one kind into
    the other would leave later stages reading the wrong one."""
    if many and (output_dir / CONFIG_FILE).is_file():
        raise UserError(f"--output_dir {output_dir} holds a single run's files; give the list its own folder")
    if not many and (output_dir / BATCH_FILE).is_file():
        raise UserError(f"--output_dir {output_dir} holds a batch ({BATCH_FILE}); give this run its own folder")


def write_index(output_dir: Path, folders: list[str], entries: list[Entry]) -> Path:
    """`batch.json`: the entries' folders in list order (relative to it), with what each set."""
    videos = [{"folder": folder, **entry.flags()} for folder, entry in zip(folders, entries, strict=True)]
    path = output_dir / BATCH_FILE
    text = json.dumps({"format": BATCH_FORMAT, "videos": videos}, indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def expand_folders(paths: list[str]) -> list[Path]:
    """Later stages' input folders: a folder holding `batch.json` (and no config of its own) stands for the
    folders it lists, in order; others are themselves. A folder named twice is refused."""
    folders: list[Path] = []
    for given in map(Path, paths):
        index = given / BATCH_FILE
        if index.is_file() and not (given / CONFIG_FILE).is_file():
            try:
                videos = json.loads(index.read_text(encoding="utf-8"))["videos"]
                folders.extend(given / video["folder"] for video in videos)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise UserError(f"{index}: not a batch index stage 1 wrote ({err})") from None
        else:
            folders.append(given)
    resolved = [folder.resolve() for folder in folders]
    for folder, where in zip(folders, resolved, strict=True):
        if resolved.count(where) > 1:
            raise UserError(f"{folder}: named twice in the input folders")
    return folders


def denoised(folder: Path) -> bool:
    """Stage 2 finished this folder from its current stage-1 files: its section names them, no checkpoint."""
    try:
        config = read_config(folder, needs="stage2")
    except UserError:
        return False
    fresh = config["stage2"].get("stage1_sha256") == config["stage1"].get("sha256")
    return fresh and (folder / STAGE2_FILE).is_file() and not (folder / CHECKPOINT_FILE).is_file()
