"""The registry: the built-in families and those other packages register (an entry point in
`ENTRY_POINT_GROUP`), and what is gathered from them: their presets, published configs, own request
options and media inputs, and the check that a request's options are its family's."""

from __future__ import annotations

from typing import Any

from tpu_video.cli import UserError, log
from tpu_video.cli.options import Option
from tpu_video.engine.batch_folders import ENTRY_FIELDS
from tpu_video.engine.inputs import MediaInput
from utils import NOT_OPTIONS, REQUEST_KEYS, SHARED_FIELDS

from . import cogvideox, hunyuanvideo15, ltx2, wan
from .family import Family, Preset, family_members

SHARED_NAMES = tuple(field.name for field in SHARED_FIELDS)

# Other packages add families by declaring an entry point in this group (a name and the module providing
# family.Family's names), as tests/toy_family does; docs/architecture.md#adding-a-family.
ENTRY_POINT_GROUP = "tpu_video.families"


def _registered_families() -> list[Family]:
    """The installed packages' families; one that fails to import or clashes (`_clash`) is left out with a
    warning (the other families still run)."""
    from importlib.metadata import entry_points

    built_in: list[Family] = [cogvideox, hunyuanvideo15, wan, ltx2]
    families = list(built_in)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            family = entry.load()
            clash = _clash(family, families)
        except Exception as err:  # a third party's import may raise anything; it must not stop the others
            clash = f"failed to import ({type(err).__name__}: {err})"
        if clash:
            log(f"warning: the model family {entry.name} ({entry.value}) is left out: {clash}")
        else:
            families.append(family)
    return families


# Names a family's options and media inputs cannot take: the shared request's and a prompt list entry's keys,
# what a config holds besides the request, and the stage flags a stage builds beside the families'
# (stages/request.py leaves out, with a warning, a flag argparse still finds taken).
RESERVED_NAMES = frozenset(
    (*REQUEST_KEYS, *SHARED_NAMES, *NOT_OPTIONS, *ENTRY_FIELDS, "model", "output_dir", "input_dir", "backend")
)


def _clash(family: Family, families: list[Family]) -> str | None:
    """Why `family` cannot join `families`: a member of the interface missing; its name, a preset or a pipeline
    class taken; an option or input named as a reserved key, twice, or declared otherwise before it."""
    missing = [name for name in family_members() if not hasattr(family, name)]
    if missing:
        return f"it lacks {', '.join(missing)} (tpu_video.models.family.Family)"
    if family.NAME in {other.NAME for other in families}:
        return f"the name {family.NAME!r} is taken"
    for what, theirs, mine in (
        ("presets", {name for other in families for name in other.PRESETS}, set(family.PRESETS)),
        (
            "pipeline classes",
            {name for other in families for name in other.PIPELINE_CLASSES},
            set(family.PIPELINE_CLASSES),
        ),
    ):
        if mine & theirs:
            return f"the {what} {sorted(mine & theirs)} are taken"
    names = [item.name for item in (*family.OPTIONS, *family.MEDIA_INPUTS)]
    bad = sorted(
        {name for name in names if name in RESERVED_NAMES or name.startswith("stage") or names.count(name) > 1}
    )
    if bad:
        return f"its options or inputs {bad} are reserved names or declared twice"
    declared = {item.name: item for other in families for item in (*other.OPTIONS, *other.MEDIA_INPUTS)}
    differ = [item.name for item in (*family.OPTIONS, *family.MEDIA_INPUTS) if declared.get(item.name, item) != item]
    return f"its options or inputs {differ} are declared otherwise before it" if differ else None


FAMILIES: dict[str, Family] = {family.NAME: family for family in _registered_families()}
# Every family's own request options by name (a name two families declare is the same declaration).
FAMILY_OPTIONS: dict[str, Option] = {option.name: option for family in FAMILIES.values() for option in family.OPTIONS}
# Every family's media inputs by name (stage 1's input flags; one name, one declaration).
MEDIA_INPUTS: dict[str, MediaInput] = {
    media.name: media for family in FAMILIES.values() for media in family.MEDIA_INPUTS
}

PRESETS: dict[str, Preset] = {name: preset for family in FAMILIES.values() for name, preset in family.PRESETS.items()}
# Published hub ids by their components' configs (each family's `PUBLISHED`), to plan offline.
PUBLISHED: dict[str, dict[str, Any]] = {
    hub_id: pipeline for family in FAMILIES.values() for hub_id, pipeline in family.PUBLISHED.items()
}


def check_options(family: Family, request) -> None:
    """The request's options are the family's own (another family's, given to this one, would be silently
    unused) and of their declared types."""
    declared = {option.name: option for option in family.OPTIONS}
    for name, value in request.options.items():
        if name not in declared:
            takers = [other.NAME for other in FAMILIES.values() if name in {o.name for o in other.OPTIONS}]
            if not takers:
                raise UserError(f"the request holds {name!r}, which no model family takes (a hand-edited config?)")
            raise UserError(
                f"--{name} is an option of {' and '.join(takers)} ({FAMILY_OPTIONS[name].help}); "
                f"{request.model_family} does not take it"
            )
        declared[name].check(value)


def stage1_only(family: Family) -> tuple[str, ...]:
    """The family's options only stage 1 acts on (a request fingerprint leaves them out)."""
    return tuple(option.name for option in family.OPTIONS if not option.later)


LATER_PASS = "pass from given latents: give stage 2 --start_latents FOLDER (an --upsample folder or an earlier pass)"


def start_only_flag(family: Family, request, option: Option) -> str:
    """How a start-only option got its value: the option whose value brought it (Option.implies), else itself."""
    for other in family.OPTIONS:
        chosen = request.option(other.name)
        if option.name in other.implies.get(chosen, {}):
            return f"--{other.name} {chosen} (it sets --{option.name} {request.option(option.name)})"
    return f"--{option.name} {request.option(option.name)}"


def check_started(family: Family, request, started: bool) -> None:
    """An option that acts only on a pass from given latents (Option.start_only), set in a pass from noise, is
    refused: it would change nothing."""
    for option in family.OPTIONS:
        value = request.option(option.name)
        if option.start_only and value is not None and not started:
            raise UserError(f"{start_only_flag(family, request, option)} acts only on a {LATER_PASS}")


def input_defaults(family: Family, source, inputs) -> dict[str, Any]:
    """The values the family's options take with the media inputs given (Option.input_default; a callable one
    is the checkpoint's, given `source`)."""
    values = {
        option.name: option.input_default
        for option in family.OPTIONS
        if set(option.inputs) & set(inputs) and option.input_default is not None
    }
    return {name: value(source) if callable(value) else value for name, value in values.items()}


def check_option_inputs(family: Family, request, inputs, accepted=None) -> None:
    """An option that acts only with a media input (Option.with_input), set without it, is refused: it would
    change nothing. `inputs`: the names stage 1 was given (or recorded); `accepted`: the media inputs the model
    takes, where known (the error then says when it takes none of the option's)."""
    for option in family.OPTIONS:
        value = request.option(option.name)
        if option.inputs and value is not None and not set(option.inputs) & set(inputs):
            given = " or ".join(f"--{name}" for name in option.inputs)
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            never = accepted is not None and not set(option.inputs) & {media.name for media in accepted}
            raise UserError(
                f"--{option.name} {shown} acts only with stage 1's {given}"
                + (", which this --model does not take" if never else "")
            )


def options_of(family_name: str | None) -> tuple[Option, ...]:
    """A family's request options by its name (none for a name no family has: the request check says so)."""
    family = FAMILIES.get(family_name)
    return family.OPTIONS if family is not None else ()
