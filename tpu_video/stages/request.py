"""The generation request's flags and stage 1's media-input flags, built from the declarations: the shared
options (utils.REQUEST_OPTIONS) in one group, every registered family's own (its `OPTIONS`) in a group
named for the family, and every family's media inputs (its `MEDIA_INPUTS`). In stage 1 an omitted request
flag takes the family's default; in a later stage it keeps the value from generation_config.json, and a
given one is recorded as an override."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from tpu_video import models
from tpu_video.cli import log
from tpu_video.cli.options import add_options, with_implied
from utils import REQUEST_KEYS, REQUEST_OPTIONS, Request


def add_request_arguments(parser, *, for_later_stage: bool) -> None:
    where = "default: from generation_config.json" if for_later_stage else "default: the model family's"
    add_options(
        parser.add_argument_group("generation request", f"({where})"), REQUEST_OPTIONS, for_later_stage=for_later_stage
    )
    shown: set[str] = set()
    added: list[str] = []
    for family in models.FAMILIES.values():
        own = [o for o in family.OPTIONS if o.name not in shown and (o.later or not for_later_stage)]
        shown.update(option.name for option in family.OPTIONS)
        if own:
            group = parser.add_argument_group(f"{family.NAME} options", f"({where}; other families refuse them)")
        for option in own:
            add = functools.partial(add_options, group, (option,), for_later_stage=for_later_stage)
            if _unless_taken(family, option.name, add):
                added.append(option.name)
    parser.set_defaults(**{OPTION_NAMES: tuple(added)})


def note_stage1_flags(parser) -> None:
    """A later stage's parser names stage 1's own flags (the prompts, the media inputs, the options stage 1
    encodes with) when they are given to it, instead of argparse's "unrecognized arguments"."""
    names = ["prompt", "negative_prompt", "prompts", "seeds"]
    for family in models.FAMILIES.values():
        names += [media.name for media in family.MEDIA_INPUTS] + [o.name for o in family.OPTIONS if not o.later]
    parser.elsewhere = {
        f"--{name}": f"--{name} is stage 1's (it changes what stage 1 encodes): rerun stage1_text_encoder.py with it "
        "(its --help lists it)"
        for name in names
    }


# Where a parser keeps the names of the family flags it holds: a flag left out (its name taken by a stage
# flag) must not be read, or the stage's own flag's value would pass for the family's.
OPTION_NAMES, INPUT_NAMES = "_family_option_flags", "_media_input_flags"


def _unless_taken(family, name: str, add) -> bool:
    """Add a family's flag; one a stage already has is left out with a warning (the other flags still work:
    a family from another package must not break the stages). Whether it was added."""
    try:
        add()
    except argparse.ArgumentError:
        log(f"warning: --{name} of the model family {family.NAME} is left out: this stage has a flag of that name")
        return False
    return True


def request_flags(args) -> dict[str, Any]:
    """The request flags the command line gave (None where omitted): the shared ones and the family options
    the parser holds (cli.options.with_implied adds what a given option's value brings, once the family is
    known)."""
    return {name: getattr(args, name, None) for name in (*REQUEST_KEYS, *getattr(args, OPTION_NAMES, ()))}


def media_flags(args) -> dict[str, str | None]:
    """Stage 1's media-input flags as given (None where omitted), those the parser holds."""
    return {name: getattr(args, name, None) for name in getattr(args, INPUT_NAMES, ())}


def request_from_flags(args, family, model_id: str, defaults: dict[str, Any]) -> Request:
    """Stage 1: the family's defaults, then every request flag given on the command line (shared or any
    family's option: models.validate_request refuses another family's)."""
    given = with_implied(family.OPTIONS, request_flags(args))
    given = {key: value for key, value in given.items() if value is not None}
    values = {**defaults, "model_family": family.NAME, "model_id": model_id}
    values.update(prompt=args.prompt, negative_prompt=args.negative_prompt, dtype=args.dtype)
    return Request.from_values({**values, **given})


def add_media_arguments(parser) -> None:
    """Stage 1's media-input flags: every family's (models.MEDIA_INPUTS); which of them a model takes is its
    family's media_inputs(source), checked before anything loads."""
    group = parser.add_argument_group("media inputs", "(what the model conditions on besides the prompt)")
    seen: set[str] = set()
    added: list[str] = []
    for family in models.FAMILIES.values():
        for media in family.MEDIA_INPUTS:
            if media.name not in seen:  # each name once, as its first family declares it
                seen.add(media.name)
                many = {"nargs": "+"} if media.many else {}
                add = functools.partial(group.add_argument, f"--{media.name}", metavar="PATH", help=media.help, **many)
                if _unless_taken(family, media.name, add):
                    added.append(media.name)
    parser.set_defaults(**{INPUT_NAMES: tuple(added)})
