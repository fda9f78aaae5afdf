"""The flags of ``semantic serve``: one per Settings field, made from the field (name, type,
description, default, range), so a new setting gets its flag by itself.

``--max-batch 4`` sets ``max_batch``; a boolean has both spellings (``--worker`` /
``--no-worker``). A flag's value goes through ``load_settings`` like a ``SEMANTIC_*``
variable's, so it is checked and its errors read the same; a flag given overrides the
variable and the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from app.settings import BOUNDS, Settings, variable_of

GROUP_TITLE = "settings (each also a SEMANTIC_* variable and a key of config.toml; a flag overrides both)"
METAVARS: dict[Any, str] = {int: "N", float: "NUMBER", Path: "DIR", dict[str, str]: "NAME=VALUE,..."}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(item: FieldInfo) -> str:
    value = item.get_default(call_default_factory=True)
    if isinstance(value, Path):
        return "~/" + str(value.relative_to(Path.home())) if value.is_relative_to(Path.home()) else str(value)
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else "none" if value == {} else str(value)


def _help(name: str, item: FieldInfo) -> str:
    facts = [variable_of(name), f"default {_default_text(item)}"]
    if name in BOUNDS:
        facts.append("{}..{}".format(*BOUNDS[name]))
    return f"{item.description} ({'; '.join(facts)})".replace("%", "%%")  # argparse formats help with %


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """A flag on ``parser`` for every Settings field; ``setting_overrides`` reads them back."""
    group = parser.add_argument_group(GROUP_TITLE)
    for name, item in Settings.model_fields.items():
        if item.annotation is bool:
            group.add_argument(flag_of(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=_help(name, item))
        else:
            group.add_argument(flag_of(name), dest=name, default=None, help=_help(name, item),
                               metavar=METAVARS.get(item.annotation, name.upper()))
    parser.set_defaults(setting_flags=tuple(Settings.model_fields))


def setting_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave (a string, or a boolean), for ``load_settings``."""
    given = {name: getattr(args, name) for name in getattr(args, "setting_flags", ())}
    return {name: value for name, value in given.items() if value is not None}
