"""The flags of ``semantic serve``: one per Settings field, made from the field (name, type,
doc, default, range), so a new setting gets its flag by itself.

``--max-batch 4`` sets ``max_batch``; a boolean has both spellings (``--worker`` /
``--no-worker``). A flag's value goes through ``load_settings`` like a ``SEMANTIC_*``
variable's, so it is checked and its errors read the same; a flag given overrides the
variable and the file.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from app.settings import BOUNDS, Settings, settings_kinds, variable_of

GROUP_TITLE = "settings (each also a SEMANTIC_* variable and a key of config.toml; a flag overrides both)"
METAVARS: dict[Any, str] = {int: "N", float: "NUMBER", Path: "DIR", dict[str, str]: "NAME=VALUE,..."}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(item: Field[Any]) -> str:
    if item.default_factory is not MISSING:
        value = item.default_factory()
        if isinstance(value, Path):
            return "~/" + str(value.relative_to(Path.home())) if value.is_relative_to(Path.home()) else str(value)
        return "none" if not value else str(value)
    if isinstance(item.default, bool):
        return str(item.default).lower()
    return '""' if item.default == "" else str(item.default)


def _help(item: Field[Any]) -> str:
    bounds = BOUNDS.get(item.name)
    facts = [variable_of(item.name), f"default {_default_text(item)}"]
    if bounds is not None:
        facts.append(f"{bounds[0]}..{bounds[1]}")
    return f"{item.metadata['doc']} ({'; '.join(facts)})".replace("%", "%%")  # argparse formats help with %


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """A flag on ``parser`` for every Settings field; ``setting_overrides`` reads them back."""
    group = parser.add_argument_group(GROUP_TITLE)
    kinds = settings_kinds()
    for item in fields(Settings):
        if kinds[item.name] is bool:
            group.add_argument(flag_of(item.name), dest=item.name, action=argparse.BooleanOptionalAction,
                               default=None, help=_help(item))
        else:
            group.add_argument(flag_of(item.name), dest=item.name, default=None, help=_help(item),
                               metavar=METAVARS.get(kinds[item.name], item.name.upper()))
    parser.set_defaults(setting_flags=tuple(item.name for item in fields(Settings)))


def setting_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave (a string, or a boolean), for ``load_settings``."""
    given = {name: getattr(args, name) for name in getattr(args, "setting_flags", ())}
    return {name: value for name, value in given.items() if value is not None}
