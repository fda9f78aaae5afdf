"""`semantic serve`'s flags: one per Settings field, named with its SEMANTIC_* variable, and
a flag's value reaches the Settings (over the variable), the worker child's included."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from app.cli import build_parser
from app.errors import ConfigError
from app.setting_flags import flag_of, setting_overrides
from app.settings import BOUNDS, Settings, as_environment, load_settings, settings_kinds

# Strings the settings check (anything else is refused at start).
CHECKED = {"kv_format": "q8", "log_format": "json", "log_level": "DEBUG", "dtype": "float16",
           "kv_formats": "m1=q8,m2=auto"}


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def other_value(name: str, kind: Any, default: Any, tmp_path: Path) -> tuple[list[str], Any]:
    """Command-line words giving ``name`` a value other than its default, and that value."""
    if kind is bool:
        return [flag_of(name) if not default else "--no-" + flag_of(name)[2:]], not default
    if kind is Path:
        return [flag_of(name), str(tmp_path / name)], tmp_path / name
    if kind == dict[str, str]:
        text = CHECKED.get(name, "a=b,c=d")
        return [flag_of(name), text], dict(pair.split("=") for pair in text.split(","))
    if kind in (int, float):
        low, high = BOUNDS.get(name, (1, 1 << 20))
        value = kind(low) if default != low else kind(high)
        return [flag_of(name), str(value)], value
    value = CHECKED.get(name, f"{name}-from-a-flag")
    return [flag_of(name), value], value


def test_every_setting_has_a_serve_flag_named_with_its_variable() -> None:
    options = {a.dest: a for a in serve_parser()._actions if a.option_strings}
    for name, item in Settings.model_fields.items():
        action = options[name]
        assert flag_of(name) in action.option_strings, name
        shown = action.help.replace("%%", "%")  # as argparse prints it
        assert f"SEMANTIC_{name.upper()}" in shown and item.description in shown, name
    # The spellings users already type.
    assert {"--host", "--port", "--model", "--no-worker", "--insecure-no-auth"} <= {
        flag for a in options.values() for flag in a.option_strings}


def test_each_flag_value_reaches_the_settings_over_the_environment(tmp_path: Path) -> None:
    defaults = Settings()
    words: list[str] = []
    expected: dict[str, Any] = {}
    for name, kind in settings_kinds().items():
        flag, value = other_value(name, kind, getattr(defaults, name), tmp_path)
        words += flag
        expected[name] = value
    env = {"SEMANTIC_PORT": "9000", "SEMANTIC_MAX_BATCH": "2", "SEMANTIC_HOME": str(tmp_path / "env-home")}
    settings = load_settings(env, **setting_overrides(serve_parser().parse_args(words)))
    assert settings.as_dict() == expected  # every field, the variables overridden
    # The worker child started with these settings' environment has the same settings.
    assert load_settings(as_environment(settings)) == settings


def test_no_flag_leaves_the_variable_and_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("threads = 5\nmax_queue = 7\n")
    env = {"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_MAX_QUEUE": "9"}
    settings = load_settings(env, **setting_overrides(serve_parser().parse_args(["--port", "8123"])))
    assert (settings.port, settings.threads, settings.max_queue, settings.worker) == (8123, 5, 9, True)


def test_a_home_flag_reads_that_homes_config_file(tmp_path: Path) -> None:
    flagged = tmp_path / "flagged"
    flagged.mkdir()
    (flagged / "config.toml").write_text("threads = 6\n")
    args = serve_parser().parse_args(["--home", str(flagged)])
    settings = load_settings({"SEMANTIC_HOME": str(tmp_path / "other")}, **setting_overrides(args))
    assert (settings.home, settings.threads) == (flagged, 6)


@pytest.mark.parametrize("words,message", [
    (["--port", "eighty"], "port: expected an integer, got 'eighty'"),
    (["--port", "70000"], "port: 70000 is outside 1..65535"),
    (["--default-temperature", "warm"], "default_temperature: expected a number"),
    (["--model-aliases", "fast"], "model_aliases: expected alias=model pairs"),
    (["--log-format", "xml"], "log_format: 'xml' is not text or json"),
])
def test_a_bad_flag_value_is_the_settings_error(words: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings({}, **setting_overrides(serve_parser().parse_args(words)))


def test_only_serve_takes_settings_from_its_arguments() -> None:
    """`models import --dtype` and `pool up --port` are their own options, not settings."""
    args = build_parser().parse_args(["models", "import", "x.gguf", "--dtype", "float16"])
    assert setting_overrides(args) == {}
