"""The three stages from Python, in one process: what the stage scripts run, called with keyword arguments
instead of a command line (docs/python-api.md).

    from tpu_video import api

    folder = api.encode(model="tiny-wan2.1", prompt="a cat on a mat", output_dir="run")
    api.denoise(folder)
    video = api.decode(folder)  # run/output_video.mp4

Each keyword is one of the stage's flags without its dashes (`num_inference_steps=30`); an unknown one is
refused. True gives a switch (`save_frames=True`; False gives `--no-k_smoothing` where the flag has that form),
None and False leave a flag out, a list gives a repeatable flag's values (`lora=["a.safetensors:0.8"]`) or a
flag's several values (`input_dir=["run1", "run2"]`). The stage checks them exactly as its command line does;
what it refuses raises `tpu_video.cli.UserError` (a Python exception here, not an exit), and SIGTERM
`tpu_video.cli.Stopped`. The files are the stage scripts' own, written where asked, so a folder made here
continues from the shell and back. `--plan` and `--help` are the command line's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError, run_ended, sigterm_stops
from tpu_video.engine.batch_folders import expand_folders
from tpu_video.stages import stage1_flags, stage1_run, stage2_flags, stage2_run, stage3_flags, stage3_run
from tpu_video.workarounds.warning_filters import filter_harmless_warnings
from utils import read_config

Folders = str | Path | list[str | Path]


def encode(*, model: str, prompt: str | None = None, output_dir: str | Path, **flags: Any) -> Path:
    """Stage 1 (stage1_text_encoder.py): the prompt's embeddings and the request in `output_dir` (with
    `prompts=FILE` or `seeds=...`: a batch folder of them)."""
    _run("stage1_text_encoder.py", stage1_flags, stage1_run, model=model, prompt=prompt, output_dir=output_dir, **flags)
    return Path(output_dir)


def denoise(input_dir: Folders, **flags: Any) -> Path | list[Path]:
    """Stage 2 (stage2_transformer.py): the latents of each input folder's request (several folders, or a batch
    folder, as the command line takes them); the folder written, or one per video."""
    _run("stage2_transformer.py", stage2_flags, stage2_run, input_dir=input_dir, **flags)
    if flags.get("output_dir"):
        return Path(flags["output_dir"])
    return _one_or_all(_folders(input_dir))


def decode(input_dir: Folders, **flags: Any) -> Path | list[Path]:
    """Stage 3 (stage3_vae_decoder.py): the mp4 of each input folder's latents; its path, or one per video."""
    _run("stage3_vae_decoder.py", stage3_flags, stage3_run, input_dir=input_dir, **flags)
    if flags.get("output_video"):
        return Path(flags["output_video"])
    written = [Path(flags.get("output_dir") or folder) for folder in _folders(input_dir)]
    return _one_or_all([folder / read_config(folder, needs="stage3")["stage3"]["file"] for folder in written])


def _folders(input_dir: Folders) -> list[Path]:
    """The stage folders an --input_dir names (a batch folder stands for those its batch.json lists)."""
    return expand_folders([str(path) for path in (input_dir if isinstance(input_dir, list) else [input_dir])])


def _one_or_all(paths: list[Path]) -> Path | list[Path]:
    return paths[0] if len(paths) == 1 else paths


def _run(script: str, flags_module, run_module, **flags: Any) -> None:
    refused = [name for name in ("plan", "help") if flags.get(name)]
    if refused:
        raise UserError(f"{refused[0]}=: run --{refused[0]} from the command line ({script} --{refused[0]} ...)")
    parser = flags_module.build_parser(script, None)

    def refuse(message: str):  # argparse's own errors as the exception the stages raise, not an exit
        raise UserError(message)

    parser.error = refuse
    args = parser.parse_args(_argv(parser, flags))
    filter_harmless_warnings()
    try:
        with sigterm_stops():
            run_module.run(args)
    finally:
        run_ended()  # the stage folders held are let go, so the next call (or a command line) may use them


def _argv(parser, flags: dict[str, Any]) -> list[str]:
    """Keywords as the stage's flags (each checked to be one): True a switch, False its `--no-` form or left
    out, None left out, a list the values of a repeatable flag (each with its flag) or of a flag taking
    several; a single value as `--name=value`, so one starting with a dash is a value."""
    actions = parser._option_string_actions
    unknown = [name for name in flags if f"--{name}" not in actions]
    if unknown:
        raise UserError(f"{', '.join(unknown)}: not a flag of this stage (see its --help)")
    argv: list[str] = []
    for name, value in flags.items():
        action = actions[f"--{name}"]
        if value is None or (value is False and not isinstance(action, argparse.BooleanOptionalAction)):
            continue
        if value is True or value is False:
            argv.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, list | tuple):
            repeated = isinstance(action, argparse._AppendAction)
            argv.extend([f"--{name}={item}" for item in value] if repeated else [f"--{name}", *map(str, value)])
        else:
            argv.append(f"--{name}={value}")
    return argv
