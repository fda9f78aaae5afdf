from pathlib import Path
from typing import get_type_hints

import pytest

from app.errors import ConfigError
from app.settings import BOUNDS, Settings, load_settings


def test_defaults_bind_localhost_port_8000(tmp_path: Path) -> None:
    settings = load_settings({"SEMANTIC_HOME": str(tmp_path)})
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8000, Settings().model)
    assert settings.db_path == tmp_path / "semantic.db"


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('port = 9001\nmodel = "m1"\ncache_reuse = false\n')
    env = {"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_MODEL": "m2"}
    settings = load_settings(env)
    assert (settings.port, settings.model, settings.cache_reuse) == (9001, "m2", False)
    assert load_settings(env, port=9002).port == 9002


def test_explicit_config_file(tmp_path: Path) -> None:
    path = tmp_path / "other.toml"
    path.write_text("threads = 3\n")
    assert load_settings({"SEMANTIC_CONFIG": str(path)}).threads == 3


@pytest.mark.parametrize("env, message", [
    ({"SEMANTIC_PORT": "eighty"}, "port: expected an integer"),
    ({"SEMANTIC_PORT": "70000"}, "port: 70000 is outside 1..65535"),
    ({"SEMANTIC_THREADS": "0"}, "threads: 0 is outside 2..1024"),
    ({"SEMANTIC_MAX_QUEUE": "-1"}, "max_queue: -1 is outside"),
    ({"SEMANTIC_MAX_BATCH": "0"}, "max_batch: 0 is outside"),
    ({"SEMANTIC_MAX_BODY_BYTES": "0"}, "max_body_bytes: 0 is outside"),
    ({"SEMANTIC_CACHE_TTL_SECONDS": "100000000000000"}, "cache_ttl_seconds: 100000000000000 is outside"),
    ({"SEMANTIC_DB_BUSY_TIMEOUT_S": "-2"}, "db_busy_timeout_s: -2.0 is outside"),
    ({"SEMANTIC_CACHE_REUSE": "maybe"}, "cache_reuse: expected a boolean"),
    ({"SEMANTIC_KV_FORMAT": "q2"}, "kv_format: 'q2' is not auto or one of q4r, q4c, k5c, k6v4, k8v4, q8, f16"),
    ({"SEMANTIC_KV_FORMATS": "gemma3-270m=q8,smol=q3"}, "kv_formats: smol: 'q3' is not auto or one of"),
    ({"SEMANTIC_KV_FORMATS": "gemma3-270m"}, "kv_formats: expected model=format pairs"),
])
def test_bad_values_are_named(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings({"SEMANTIC_HOME": str(tmp_path), **env})


def test_every_numeric_setting_has_bounds_its_default_meets() -> None:
    numeric = {name for name, kind in get_type_hints(Settings).items() if kind in (int, float)}
    assert numeric == set(BOUNDS)
    for name, (low, high) in BOUNDS.items():
        assert low <= getattr(Settings(), name) <= high, name


def test_values_read_as_before_the_pydantic_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What app/settings.py's own validator and sources keep: a switch is no number nor a number a
    switch, text may have spaces around it, only the exact SEMANTIC_* spellings are read, and
    Settings(...) reads no environment (load_settings does)."""
    for text, message in (("port = true", "port: expected an integer, got True"),
                          ("worker = 1", "worker: expected a boolean, got 1")):
        (tmp_path / "config.toml").write_text(text + "\n")
        with pytest.raises(ConfigError, match=message):
            load_settings({"SEMANTIC_HOME": str(tmp_path)})
    env = {"SEMANTIC_HOME": f" {tmp_path / 'other'} ", "SEMANTIC_WORKER": " false ", "SEMANTIC_PORT": " 81 ",
           "semantic_threads": "3", "Semantic_Max_Batch": "3"}
    settings = load_settings(env)
    assert (settings.home, settings.worker, settings.port) == (tmp_path / "other", False, 81)
    assert (settings.threads, settings.max_batch) == (Settings().threads, Settings().max_batch)
    monkeypatch.delenv("SEMANTIC_CONFIG", raising=False)
    monkeypatch.setenv("SEMANTIC_HOME", str(tmp_path / "env"))
    monkeypatch.setenv("SEMANTIC_PORT", "9999")
    assert Settings().port == 8000 and load_settings().port == 9999


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown settings prot"):
        load_settings({"SEMANTIC_HOME": str(tmp_path)})


def test_cache_reuse_switch_from_environment(tmp_path: Path) -> None:
    assert load_settings({"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_CACHE_REUSE": "0"}).cache_reuse is False


def test_float_settings(tmp_path: Path) -> None:
    assert load_settings({"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_DEFAULT_TEMPERATURE": "0"}).default_temperature == 0.0
    with pytest.raises(ConfigError, match="default_temperature: expected a number"):
        load_settings({"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_DEFAULT_TEMPERATURE": "warm"})


def test_model_aliases_from_a_toml_table_or_the_environment(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[model_aliases]\nfast = "smollm2-4bit"\n')
    assert load_settings({"SEMANTIC_HOME": str(tmp_path)}).model_aliases == {"fast": "smollm2-4bit"}
    env = {"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_MODEL_ALIASES": "fast = a, big=/models/b"}
    assert load_settings(env).model_aliases == {"fast": "a", "big": "/models/b"}
    with pytest.raises(ConfigError, match="model_aliases: expected alias=model pairs"):
        load_settings({**env, "SEMANTIC_MODEL_ALIASES": "fast"})


def test_kv_format_is_auto_unless_pinned_globally_or_per_model(tmp_path: Path) -> None:
    assert load_settings({"SEMANTIC_HOME": str(tmp_path)}).kv_format_for("any") == "auto"
    (tmp_path / "config.toml").write_text('kv_format = "q8"\n[kv_formats]\ngemma3-270m = "auto"\nsmol = "f16"\n')
    settings = load_settings({"SEMANTIC_HOME": str(tmp_path)})
    assert [settings.kv_format_for(m) for m in ("gemma3-270m", "smol", "other")] == ["auto", "f16", "q8"]
    env = {"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_KV_FORMATS": "smol=k6v4"}
    assert load_settings(env).kv_formats == {"smol": "k6v4"}  # the environment replaces the file's table


def _installed(models: Path, name: str) -> Path:
    (models / name).mkdir(parents=True)
    (models / name / "config.json").write_text("{}")
    return models / name


def test_catalog_resolves_aliases_installed_names_and_unknown_names(tmp_path: Path) -> None:
    from app.catalog.registry import Catalog
    from app.errors import NotFound

    models = tmp_path / "models"
    _installed(models, "small")
    _installed(models, "other")
    elsewhere = _installed(tmp_path / "elsewhere", "big")
    catalog = Catalog.configure(models, "small", {"fast": "other", "large": str(elsewhere)}, map_unknown=False)
    assert [catalog.resolve(n) for n in (None, "", "default", "fast", "large", "big", "other", "small")] == \
        ["small", "small", "small", "other", "big", "big", "other", "small"]
    assert catalog.path("big") == elsewhere and catalog.path("other") == models / "other"
    for unknown in ("claude-sonnet-5", "../elsewhere/big", str(elsewhere), "big/../small"):
        with pytest.raises(NotFound, match="not a model this server serves"):
            catalog.resolve(unknown)
    _installed(models, "third")  # installed, configured nowhere, any_installed off: no client may swap it in
    with pytest.raises(NotFound, match="'third' is installed but not served here"):
        catalog.resolve("third")
    with pytest.raises(NotFound, match="not a model this server serves .*'small'"):  # nor import an embedded model
        catalog.resolve("gemma3-270m")
    assert [m.name for m in (models / "third", models / "other") if catalog.servable(m.name)] == ["other"]
    anything = Catalog.configure(models, "small", {}, map_unknown=False, any_installed=True)
    assert anything.resolve("third") == "third" and anything.servable("third")
    with pytest.raises(NotFound):
        anything.resolve("gemma3-270m")  # embedded, not installed: only the configuration imports it
    mapping = Catalog.configure(models, "small", {}, map_unknown=True)
    assert mapping.resolve("claude-sonnet-5") == "small" and mapping.resolve("/etc") == "small"
    # An installed model's name is never answered by another model (issue 62: gemma3-270m,
    # installed, was answered by SmolLM2 with "model": "gemma3-270m" echoed back).
    with pytest.raises(NotFound, match="'third' is installed but not served here"):
        mapping.resolve("third")
    assert Catalog.configure(models, "small", {}, map_unknown=True, any_installed=True).resolve("third") == "third"
    with pytest.raises(ConfigError, match="'missing' is not installed"):
        Catalog.configure(models, "small", {"fast": "missing"})
    with pytest.raises(ConfigError, match="'other' is already a model's name"):
        Catalog.configure(models, "small", {"other": "small"})
