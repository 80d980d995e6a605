"""Request options as data: each one a name, a JSON type, a help line and where it may be set. The shared
request (utils.REQUEST_OPTIONS) and every family (its `OPTIONS`) declare theirs with `Option`; the stages
build their flags from the declarations (`add_options`) and the request checks stored values against them
(`Option.check`), so a family adds an option without editing a shared module."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from . import UserError, finite_float, flag_names

# What each kind accepts in generation_config.json (bool is not a number here, though Python's int says so).
# "floats", "ints": one number or several (a flag taking one or more; stored as a list).
# "bool": a switch (a flag taking no value; stored as true when given).
KIND_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "floats": (list,), "ints": (list,), "bool": (bool,)}
KIND_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "floats": "a list of numbers",
    "ints": "a list of integers",
    "bool": "true or false",
}
FLAG_TYPES = {"str": str, "int": int, "float": finite_float, "floats": finite_float, "ints": int}
LISTS = {"floats": "float", "ints": "int"}  # a list kind: the kind of its items


@dataclass(frozen=True)
class Option:
    """One request option: `--name` in stage 1 (omitted: the family's default, else unset), stored as a
    top-level key of generation_config.json. `later`: stages 2 and 3 may override it (recorded as an
    override); False for what only stage 1 acts on. `splits_batch`: videos that differ in it cannot share a
    stage-2 batch (it changes the compiled program or the schedule). `implies`: per value, the defaults it
    brings (e.g. a step schedule's step count), under what the command line gives. `start_only`: it acts only
    on a pass that starts from given latents (stage 2's --start_latents). `with_input`: it acts only with that
    media input given, or with any of several (stage 1's --video for --strength), and takes `input_default` then
    (stored, so every stage checks the value that runs; a callable gives the checkpoint's, from its source)."""

    name: str
    kind: str  # a KIND_TYPES key
    help: str
    choices: tuple[str, ...] = ()
    later: bool = True
    splits_batch: bool = True
    metavar: str | None = None
    implies: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    start_only: bool = False
    with_input: str | tuple[str, ...] | None = None
    input_default: Any = None

    @property
    def inputs(self) -> tuple[str, ...]:
        """The media inputs `with_input` names (none: it acts without any)."""
        return (self.with_input,) if isinstance(self.with_input, str) else tuple(self.with_input or ())

    def check(self, value: Any) -> None:
        """Refuse a stored value of the wrong JSON type or outside the choices (a hand-edited config)."""
        if value is None:
            return
        item = LISTS.get(self.kind)
        items = item is None or all(type(one) in KIND_TYPES[item] for one in value or [None])
        if type(value) not in KIND_TYPES[self.kind] or not items:
            raise UserError(f"{self.name} is {json.dumps(value)} in the request; it must be {KIND_WORDS[self.kind]}")
        if self.choices and value not in self.choices:
            raise UserError(f"--{self.name} {value!r} is not one of {', '.join(self.choices)}")


def with_implied(options: tuple[Option, ...], given: dict[str, Any], stored=None) -> dict[str, Any]:
    """The `given` request flags (None: not given) with the defaults their values of `options` (one family's)
    bring (Option.implies) where those flags are not given. `stored`: a later stage's request, whose own value
    of an option brings nothing again (its scales stay as stage 1 set them)."""
    implied: dict[str, Any] = {}
    for option in options:
        value = given.get(option.name)
        if value is not None and option.implies and (stored is None or stored.option(option.name) != value):
            implied.update(option.implies.get(value, {}))
    return {**given, **{name: value for name, value in implied.items() if given.get(name) is None}}


def add_options(group: argparse._ActionsContainer, options: tuple[Option, ...], *, for_later_stage: bool) -> None:
    """Each option as a flag of `group` (a later stage gets only those it may override); unset flags are
    None, so what was not given is told apart from a default."""
    for option in options:
        if for_later_stage and not option.later:
            continue
        if option.kind == "bool":
            group.add_argument(
                *flag_names(f"--{option.name}"), dest=option.name, action="store_const", const=True, help=option.help
            )
            continue
        group.add_argument(
            *flag_names(f"--{option.name}"),
            dest=option.name,
            type=FLAG_TYPES[option.kind],
            nargs="+" if option.kind in LISTS else None,
            choices=option.choices or None,
            metavar=option.metavar,
            help=option.help,
        )
