"""The folders `--model` resolves presets and published ids to: a tiny preset's components saved once
(`materialize_preset`) and a published pipeline's configs kept in code (`materialize_published`, for --plan), each
under the cache root, written atomically, so both load through the same `from_pretrained` path as real models."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError
from tpu_video.cli.folders import cache_root

from .registry import PRESETS, PUBLISHED


def library_class(library: str, class_name: str):
    """The class a model_index.json entry names: diffusers', transformers', or a pipeline's own module's
    (LTX-2's connectors and vocoder say "ltx2": diffusers.pipelines.ltx2)."""
    module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    try:
        return getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError):
        raise UserError(f"model_index.json names {library}.{class_name}, which this {module} does not have") from None


def _publish_folder(target: Path, write) -> Path:
    """Fill `target` through `write(staging_folder)` once, atomically (another process may race us)."""
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "model_index.json").is_file():  # not merely another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


PUBLISHED_FOLDER_LAYOUT = 3  # bump when materialize_published writes its folders differently


def _write_config(folder: Path, library: str, class_name: str, config: dict[str, Any]) -> None:
    """One published component's config files in `folder`, as its class saves them."""
    cls = library_class(library, class_name)
    folder.mkdir()
    if not hasattr(cls, "config_name"):  # transformers: a model's config class writes its config.json,
        written = cls.config_class(**config) if hasattr(cls, "config_class") else cls(**config)
        written.save_pretrained(folder)  # an image processor its preprocessor_config.json
        return
    # The class's own defaults fill what the published config leaves to them.
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty and name != "self"
    }
    (folder / cls.config_name).write_text(json.dumps({"_class_name": class_name, **defaults, **config}))


def materialize_published(hub_id: str) -> Path:
    """A diffusers folder with only the configs of a published pipeline (`PUBLISHED`): enough for
    `load_config`, schedulers and meta-device modules, never for weights."""
    pipeline = PUBLISHED[hub_id]
    # The digest covers how the folder is written too: a folder an older version wrote (without the
    # class defaults, say) is never reused.
    described = json.dumps({"layout": PUBLISHED_FOLDER_LAYOUT, **pipeline}, sort_keys=True)
    digest = hashlib.sha256(described.encode()).hexdigest()[:12]

    def write(folder: Path) -> None:
        index = {"_class_name": pipeline["_class_name"][1]}
        for component, entry in pipeline.items():
            if component.startswith("_"):
                continue
            if not isinstance(entry, tuple):  # a pipeline-level value (e.g. Wan 2.2's boundary_ratio)
                index[component] = entry
                continue
            index[component] = list(entry[:2])
            _write_config(folder / component, *entry)
        for subfolder, entry in pipeline.get("_subfolders", {}).items():  # kept beside the pipeline, not in its index
            _write_config(folder / subfolder, *entry)
        (folder / "model_index.json").write_text(json.dumps(index))

    return _publish_folder(cache_root() / "published" / f"{hub_id.replace('/', '--')}-{digest}", write)


def materialize_preset(name: str) -> Path:
    """Save a preset's tiny random components once (save_pretrained) and return the folder.

    Presets then load through the same `from_pretrained` path as real models. The folder name carries a
    hash of the component configs (tokenizers and processors: their vocabulary, chat template and settings) and of
    every saved tensor (parameters and persistent buffers, such as LTX-2's latent statistics), so a changed preset
    never reuses a stale folder.
    """
    import torch

    pipe = PRESETS[name].build()
    # Modules saved beside the pipeline's components, in subfolders model_index.json does not list (LTX-2's latent
    # upsampler, where the published repositories keep it).
    extras = getattr(pipe, "preset_extras", {})
    configs = {}
    digest = hashlib.sha256()
    for key, component in sorted({**pipe.components, **extras}.items()):
        config = getattr(component, "config", None)
        if config is not None:
            configs[key] = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        tokenizer = getattr(component, "tokenizer", component)  # a processor's, or the component itself
        if hasattr(tokenizer, "get_vocab"):  # tokenizers and processors have no config: their vocabulary and template
            configs[key] = {"vocab": tokenizer.get_vocab(), "chat_template": getattr(tokenizer, "chat_template", None)}
            if tokenizer is not component:
                configs[key]["processor"] = component.to_dict()
        if isinstance(component, torch.nn.Module):
            for tensor_name, tensor in component.state_dict().items():
                digest.update(f"{key}.{tensor_name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    # Keys starting with "_" are bookkeeping (some are unordered sets), not part of the model.
    configs = {name: {k: v for k, v in c.items() if not k.startswith("_")} for name, c in configs.items()}
    digest.update(json.dumps(configs, sort_keys=True, default=str).encode())
    digest = digest.hexdigest()[:12]

    def write(folder: Path) -> None:
        pipe.save_pretrained(folder)
        for subfolder, module in extras.items():
            module.save_pretrained(folder / subfolder)

    return _publish_folder(cache_root() / "presets" / f"{name}-{digest}", write)
