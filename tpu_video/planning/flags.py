"""What `--plan` is asked for, from the stages' flags: the TPU target, the request and stage-1 tensors it
compiles for, and where to save the programs it compiles (tpu_video/planning/plan.py compiles them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpu_video.cli import UserError, parse_dtype
from tpu_video.cli.options import with_implied
from tpu_video.planning.tpus import Target, parse_target, topology_devices
from utils import CONFIG_FILE, DEFAULT_OUTPUT_DIR, Request, read_config, read_tensors


def target_from_flag(name: str) -> Target:
    """`--plan NAME` as a Target that libtpu can build, or one `error:` line naming what is known."""
    try:
        target = parse_target(name)
        topology_devices(target)  # libtpu refuses grids no slice has
    except ValueError as err:
        raise UserError(f"--plan: {err}") from None
    return target


def executables_to_save(folder: str | None, target):
    """`--save_executables DIR` as an ExecutableStore, or None. A multi-host run keys a program per process
    (each loads its own), which one plan's compile does not give: single-host slices only."""
    from tpu_video.runtime.executables import ExecutableStore

    if folder is None:
        return None
    if target.devices_per_host != target.devices:
        hosts = target.devices // target.devices_per_host
        raise UserError(
            f"--save_executables: {target.name} spans {hosts} hosts, and saving programs for a multi-host run "
            "is not supported (each of its processes keys its own); plan a single-host slice"
        )
    return ExecutableStore("folder", Path(folder).expanduser())


def plan_folder(input_dirs: list[str] | None, model: str | None) -> Path | None:
    """The stage folder a plan reads: the given --input_dir; none when only --model is given (a plan from the
    model alone must not pick up whatever run the default folder holds); else the default folder."""
    if input_dirs:
        return Path(input_dirs[0])
    return None if model else Path(DEFAULT_OUTPUT_DIR)


def request_to_plan(input_dir: Path | None, model: str | None, flags: dict[str, Any], dtype: str | None):
    """The request, model and stage-1 tensors a plan compiles for (`planned_request`), the tensors from the
    stage folder's files, else zeros of the shapes stage 1 writes."""
    request, source, family = planned_request(input_dir, model, flags, dtype)
    if has_config(input_dir):
        return request, source, family, read_tensors(input_dir, read_config(input_dir, needs="stage1")["stage1"])
    return request, source, family, family.planning_embeds(source, request, parse_dtype(request.dtype))


def has_config(input_dir: Path | None) -> bool:
    return input_dir is not None and (input_dir / CONFIG_FILE).is_file()


def planned_request(input_dir: Path | None, model: str | None, flags: dict[str, Any], dtype: str | None):
    """The request and model a plan compiles for: from the stage folder if it has a config (as a real run
    reads it; `flags` override), else from `model` with its defaults and the given request flags. Published
    hub ids need no network."""
    from tpu_video import models

    if has_config(input_dir):
        config = read_config(input_dir, needs="stage1")
        stored = Request.from_config(config, input_dir / CONFIG_FILE)
        given = with_implied(models.options_of(stored.model_family), flags, stored)
        request, _ = stored.with_overrides({**given, "model_id": model})
        source, family = models.resolve_model_for_request(request, configs_only=True)
        models.validate_request(family, source, request)
        return request, source, family
    if not model:
        raise UserError(f"--plan needs stage-1 files in {input_dir} or a --model to plan from")
    return default_request(model, flags, dtype)


def default_request(model: str, flags: dict[str, Any], dtype: str | None = None):
    """The request a plan from `model` alone compiles for: the model's defaults and the given flags (None:
    unset), checked; with its source and family. Published hub ids need no network."""
    from tpu_video import models

    source, family = models.resolve_model(model, configs_only=True)
    given = {key: value for key, value in with_implied(family.OPTIONS, flags).items() if value is not None}
    values = {**family.request_defaults(source), "seed": 0, **given}
    request = Request.from_values(
        {"model_family": family.NAME, "model_id": model, "prompt": "", "negative_prompt": "", "dtype": dtype or "bf16"}
        | values
    )
    models.validate_request(family, source, request)
    return request, source, family
