"""Model families: resolving `--model`, detecting the family from model_index.json, built-in tiny presets.

A family (e.g. the package ``tpu_video/models/cogvideox/``) provides the names of ``family.Family``: request
defaults and validation, prompt encoding, the stage-2 denoiser, the stage-3 decoder, its rule table, tiny
presets, published configs and its own request options (``OPTIONS``). A family package holds all of its
parts; a built-in one is a package here and its import below; a family from another package registers an
entry point in ``ENTRY_POINT_GROUP`` (docs/architecture.md shows how). ``FAMILIES``, ``PRESETS``,
``PUBLISHED``, ``FAMILY_OPTIONS`` and ``MEDIA_INPUTS`` are gathered from them.

Beside the families (`cogvideox`, `hunyuanvideo15`, `wan`, `ltx2`): `registry` (the families gathered),
`family` (the interface), `model_index` (reading a model's model_index.json: a folder's, the Hugging Face
cache's or the hub's), `folders` (the folders presets and published configs are saved to), `common` (what several
families share), `tiny` (the tiny presets' T5 tokenizer and encoder) and `adapter_origin` (which published model
an adapter that does not fit was made for).
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from tpu_video.cli import UserError

from .family import Family
from .family import Preset as Preset  # re-exported: the families' presets and the tests name it here
from .folders import library_class as library_class
from .folders import materialize_preset as materialize_preset
from .folders import materialize_published as materialize_published
from .model_index import read_model_index
from .registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from .registry import FAMILIES, PRESETS, PUBLISHED, check_options
from .registry import FAMILY_OPTIONS as FAMILY_OPTIONS
from .registry import LATER_PASS as LATER_PASS
from .registry import MEDIA_INPUTS as MEDIA_INPUTS
from .registry import check_option_inputs as check_option_inputs
from .registry import check_started as check_started
from .registry import input_defaults as input_defaults
from .registry import options_of as options_of
from .registry import stage1_only as stage1_only
from .registry import start_only_flag as start_only_flag


@dataclass(frozen=True)
class ModelSource:
    """Where a pipeline's components come from.

    `ref` is what the user typed (recorded as `model_id`); `location` is what `from_pretrained` gets
    (a local folder or a hub id); `index` is the pipeline's model_index.json. `configs_only`: a published
    pipeline's configs kept in code (planning), no weights and no tokenizer files.
    """

    ref: str
    location: str
    index: dict[str, Any]
    preset_defaults: dict[str, Any] = field(default_factory=dict)
    pipeline_attributes: dict[str, Any] = field(default_factory=dict)  # a preset's (models.family.Preset)
    configs_only: bool = False

    def configure(self, pipe):
        """`pipe` (a diffusers pipeline of this source) with the preset's pipeline attributes set; returned."""
        for name, value in self.pipeline_attributes.items():
            setattr(pipe, name, value)
        return pipe

    def load_config(self, component: str) -> dict[str, Any]:
        """A component's config.json as a dict, without loading any weights (read once per process)."""
        try:
            return dict(_cached_config(component_class(self, component), self.location, component))
        except OSError as err:  # a local folder without the component, or a hub id not in the cache
            where = f"{component}/config.json is missing" if os.path.isdir(self.location) else str(err)
            raise UserError(f"--model {self.ref!r}: {where} (a diffusers folder has one per component)") from None

    def component_class(self, component: str):
        return component_class(self, component)

    def load(self, component: str, dtype=None):
        """`from_pretrained` of one component, with the class named in model_index.json."""
        cls = component_class(self, component)
        kwargs = {} if dtype is None else {"dtype": dtype}  # diffusers 0.42 and transformers 5 both say dtype
        try:
            return cls.from_pretrained(self.location, subfolder=component, **kwargs)
        except (OSError, ValueError) as err:  # ValueError: a weight's shape, a shard index that is not JSON
            raise UserError(f"cannot load {component!r} of {self.ref!r} ({type(err).__name__}: {err})") from None


@functools.lru_cache(maxsize=32)
def _cached_config(cls, location: str, component: str) -> dict[str, Any]:
    # Validation, geometry and defaults all read the same few config files; read each once.
    if hasattr(cls, "load_config"):  # diffusers models and schedulers
        return cls.load_config(location, subfolder=component)
    return cls.config_class.from_pretrained(location, subfolder=component).to_dict()  # transformers models


def component_class(source: ModelSource, component: str):
    entry = source.index.get(component)
    if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
        raise UserError(f"model_index.json of {source.ref!r} has no {component!r} component")
    return library_class(*entry)


def resolve_model(model: str, configs_only: bool = False) -> tuple[ModelSource, Family]:
    """Turn `--model` (preset name, local diffusers folder or hub id) into a source and its family module.

    With `configs_only` (planning: the architecture is all that is needed) a published hub id resolves
    to its configs kept in code (its family's `PUBLISHED`), without the network."""
    attributes, configs = {}, False
    if model in PRESETS:
        location = str(materialize_preset(model))
        defaults, attributes = PRESETS[model].defaults, PRESETS[model].pipeline_attributes
    elif configs_only and model in PUBLISHED and not os.path.isdir(model):
        location, defaults, configs = str(materialize_published(model)), {}, True
    elif os.path.isdir(model):
        location, defaults = model, {}
    elif model.startswith(("/", ".", "~")) or model.count("/") > 1:  # a path, not an "org/name" hub id
        raise UserError(f"--model {model!r}: no such folder")
    elif "/" not in model:  # neither a preset, a folder nor an "org/name" hub id: a typo, most likely
        close = difflib.get_close_matches(model, [*PRESETS, *PUBLISHED], n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; the presets: {', '.join(PRESETS)}"
        raise UserError(f"--model {model!r} is not a preset, a local folder or a hub id (owner/name){hint}")
    else:
        location, defaults = model, {}
    index = read_model_index(model, location)
    family = FAMILIES[PRESETS[model].family] if model in PRESETS else detect_family(index, model)
    source = ModelSource(
        model, location, index, preset_defaults=defaults, pipeline_attributes=attributes, configs_only=configs
    )
    return source, family


def resolve_model_for_request(
    request, model_override: str | None = None, configs_only: bool = False
) -> tuple[ModelSource, Family]:
    """The model a later stage uses: the request's `model_id` unless overridden, and of the request's family."""
    if request.model_family not in FAMILIES:
        raise UserError(
            f"the stage files are from the model family {request.model_family!r}, which is not installed here "
            f"(installed: {', '.join(FAMILIES)}; a family from another package registers in {ENTRY_POINT_GROUP})"
        )
    source, family = resolve_model(model_override or request.model_id, configs_only)
    if family.NAME != request.model_family:
        raise UserError(
            f"--model {source.ref!r} is a {family.NAME} model but the stage files are from {request.model_family}"
        )
    return source, family


def validate_request(family: Family, source: ModelSource, request) -> None:
    """Before any weights load: what every family's request must respect in the model's configs (steps
    within the scheduler's training timesteps, no flag the family does not act on), the family's own checks
    (geometry, extras), then a video small enough for the host's memory."""
    train_steps = source.load_config("scheduler").get("num_train_timesteps", 1000)
    if request.num_inference_steps > train_steps:
        raise UserError(
            f"--num_inference_steps {request.num_inference_steps} is more than the scheduler's {train_steps} "
            "training timesteps"
        )
    check_options(family, request)
    family.validate_request(source, request)
    frames = request.num_frames * request.height * request.width * 3 * 4  # what stage 3 holds as float32
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if frames > memory:
        raise UserError(
            f"--height {request.height} --width {request.width} --num_frames {request.num_frames}: the decoded "
            f"video alone is {frames / 2**30:.3g} GiB of float32 frames, more than this host's {memory / 2**30:.0f} "
            "GiB of memory"
        )


def detect_family(index: dict[str, Any], model: str) -> Family:
    """The family whose diffusers pipeline class is named in model_index.json."""
    pipeline_class = index.get("_class_name")
    for family in FAMILIES.values():
        if pipeline_class in family.PIPELINE_CLASSES:
            return family
    supported = ", ".join(cls for family in FAMILIES.values() for cls in family.PIPELINE_CLASSES)
    raise UserError(f"--model {model!r} is a {pipeline_class!r} pipeline; supported: {supported}")
