"""The three stages from Python, in one process: what the stage scripts run, called with keyword arguments
instead of a command line (docs/python-api.md).

    from tpu_video import api

    folder = api.encode(model="tiny-wan2.1", prompt="a cat on a mat", output_dir="run")
    api.denoise(folder)
    video = api.decode(folder)  # run/output_video.mp4

Each keyword is the stage's flag without its dashes (`num_inference_steps=30`); True gives a switch
(`save_frames=True`), None and False leave a flag out, a list gives a repeatable flag's values
(`lora=["a.safetensors:0.8", "b.safetensors"]`) or a flag's several values (`input_dir=["run1", "run2"]`). The
stage checks them exactly as its command line does; what it refuses raises `tpu_video.cli.UserError` (a Python
exception here, not an exit), and a requested stop `tpu_video.cli.Stopped`. The files are the stage scripts'
own, written where asked, so a folder made here continues from the shell and back.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from tpu_video.stages import stage1_flags, stage1_run, stage2_flags, stage2_run, stage3_flags, stage3_run
from tpu_video.workarounds.warning_filters import filter_harmless_warnings
from utils import CONFIG_FILE, VIDEO_FILE, read_config


def encode(*, model: str, prompt: str, output_dir: str | Path, **flags: Any) -> Path:
    """Stage 1 (stage1_text_encoder.py): the prompt's embeddings and the request in `output_dir`."""
    _run("stage1_text_encoder.py", stage1_flags, stage1_run, model=model, prompt=prompt, output_dir=output_dir, **flags)
    return Path(output_dir)


def denoise(input_dir: str | Path, **flags: Any) -> Path:
    """Stage 2 (stage2_transformer.py): the latents of `input_dir`'s request, written to `output_dir` if given,
    else beside the embeddings; the folder written."""
    _run("stage2_transformer.py", stage2_flags, stage2_run, input_dir=input_dir, **flags)
    return Path(flags.get("output_dir") or input_dir)


def decode(input_dir: str | Path, **flags: Any) -> Path:
    """Stage 3 (stage3_vae_decoder.py): the mp4 of `input_dir`'s latents; its path."""
    _run("stage3_vae_decoder.py", stage3_flags, stage3_run, input_dir=input_dir, **flags)
    folder = Path(flags.get("output_dir") or input_dir)
    if flags.get("output_video"):
        return Path(flags["output_video"])
    written = read_config(folder, needs="stage3") if (folder / CONFIG_FILE).is_file() else {}
    return folder / written.get("stage3", {}).get("file", flags.get("output_name") or VIDEO_FILE)


def _run(script: str, flags_module, run_module, **flags: Any) -> None:
    parser = flags_module.build_parser(script, None)

    def refuse(message: str):  # argparse's own errors as the exception the stages raise, not an exit
        raise UserError(message)

    parser.error = refuse
    filter_harmless_warnings()
    run_module.run(parser.parse_args(_argv(parser, flags)))


def _argv(parser, flags: dict[str, Any]) -> list[str]:
    """Keywords as the stage's flags: True a switch, None and False left out, a list the values of a
    repeatable flag (each with its flag) or of a flag taking several."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list | tuple):
            repeated = isinstance(parser._option_string_actions.get(f"--{name}"), argparse._AppendAction)
            pairs = [part for item in value for part in (f"--{name}", str(item))]
            argv.extend(pairs if repeated else [f"--{name}", *map(str, value)])
        else:
            argv.extend((f"--{name}", str(value)))
    return argv
