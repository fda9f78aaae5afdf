"""Settings: defaults, overridden by a TOML file, by ``SEMANTIC_*`` variables, by ``serve`` flags.

Read once at process start (``load_settings``) and passed down; nothing below
reads the environment. The TOML file is ``$SEMANTIC_CONFIG`` if set, else
``config.toml`` in the home (``--home``, ``$SEMANTIC_HOME``) if it exists. Its keys
are the field names below (``port = 8080``); the variable for a field is
``SEMANTIC_`` + its upper-case name (``SEMANTIC_PORT=8080``), its flag ``--port``
(``app/setting_flags.py``, made from each field's type, doc and default).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, get_type_hints

from app.errors import ConfigError
from app.types import KV_FORMAT_NAMES, RequestOptions

DEFAULT_MODEL = "smollm2-135m-instruct"


def setting(default: Any, doc: str) -> Any:
    """A field of Settings: its default (a callable, or ``dict`` for a table, is called for each
    Settings) and ``doc``, what it is for: the help of its ``semantic serve`` flag."""
    if callable(default):
        return field(default_factory=default, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of Semantic, with its default. Reference: docs/configuration.md
    (tests/unit/test_docs.py keeps it in step)."""

    home: Path = setting(lambda: Path.home() / ".semantic", "Where the database, the models and the cache files live.")
    host: str = setting("127.0.0.1", "Bind address (localhost only by default); any other address needs api_key, or "
                        "insecure_no_auth.")
    port: int = setting(8000, "TCP port.")
    model: str = setting(DEFAULT_MODEL, "The model served: a name under $SEMANTIC_HOME/models, a directory path, or a "
                         "Hugging Face repo id (org/name) found offline in the Hugging Face cache (HF_HUB_CACHE, "
                         "HF_HOME).")
    model_aliases: dict[str, str] = setting(dict, (
        "Names a request's `model` may use for installed models: alias -> model name (or directory). In TOML a "
        "table (`[model_aliases]` then `fast = \"smollm2-4bit\"`); in the environment or a flag "
        "`fast=smollm2-4bit,big=gemma3-270m`. A request naming another model than the loaded one makes the engine "
        "swap models."))
    map_unknown_models: bool = setting(True, (
        "Serve request model names (e.g. claude-sonnet-5) that are neither aliases nor served models with `model`; "
        "false answers them with 404."))
    serve_installed_models: bool = setting(False, (
        "Let requests name any model installed under $SEMANTIC_HOME/models or in the Hugging Face cache, not only "
        "`model` and the aliases' targets. Each swap reloads the model and sends every conversation's cache to "
        "disk: on a shared server, clients alternating two names would thrash them all."))
    dtype: str = setting("auto", "Compute dtype: auto = float32 on CPU (fast BLAS path), the model's own elsewhere.")
    default_temperature: float = setting(1.0, (
        "Temperature for requests that name none (Anthropic and OpenAI default to 1.0; small models given a long "
        "agent prompt ramble at 1.0 and stop sooner at 0)."))
    repetition_penalty: float = setting(1.0, (
        "Multiplicative penalty on the last 20 tokens' logits (1.0 = off); small models under long agent prompts "
        "fall into loops without it."))
    speculative_tokens: int = setting(8, (
        "The longest speculative draft, in tokens: requests guess the next tokens from the conversation "
        "(prompt-lookup n-grams) and the model checks them in one forward pass, with the same output token for "
        "token when greedy (temperature 0) and the same distribution when sampling (exact speculative sampling). "
        "0 = off; a request turns it off with speculate false (OpenAI, Anthropic, Responses, direct agent API)."))
    max_output_tokens: int = setting(131072, "Upper bound for a request's max_tokens; larger values are a 400.")
    default_max_tokens: int = setting(512, (
        "Output bound of requests that set none (OpenAI may omit max_tokens; the direct API too)."))
    stable_prompts: bool = setting(True, (
        "Make what Claude Code's prompts change between requests stable (billing header dropped, tools sorted, the "
        "git status snapshot pinned per conversation): app/protocol/claude_code.py."))
    fit_prompts: bool = setting(True, (
        "A prompt beyond the context drops optional sections (Claude Code's auto memory instructions) before it is "
        "refused as too long."))
    prefill_step_size: int = setting(0, (
        "The largest prefill chunk in tokens (bounds peak memory on long prompts): a prompt prefilling alone takes "
        "chunks of this size; while other requests run, chunks are sized to take about 0.25 s so that none waits "
        "long. 0 = per backend (app/engine/backend.py): 256 on a CPU, 2048 on a GPU; startup logs the choice."))
    max_batch: int = setting(8, "Generations the engine runs at once (prefilling or decoding, in one batch).")
    max_queue: int = setting(16, "Requests waiting for a place in the batch before new ones get 429.")
    threads: int = setting(32, (
        "Waitress worker threads (each streaming response holds one): more than max_batch + max_queue, so a full "
        "engine answers 429 and /health still answers."))
    split_cores: bool = setting(True, (
        "With several sequences decoding on a CPU with OpenBLAS, split each step over both cores (half of every "
        "projection and of the rows' attention on a second MLX stream, OpenBLAS on one thread) for more "
        "aggregate tok/s. See app/engine/cores.py."))
    cache_reuse: bool = setting(True, "Reuse KV caches across turns (false: every prompt is prefilled cold).")
    cache_memory_bytes: int = setting(0, (
        "Bytes of KV cache kept in memory (the hot tier): the stored blocks, plus the float working copies of the "
        "4 most recent conversations; the rest waits on disk. The same budget bounds the working caches of the "
        "generations running at once (admission). 0 = from the machine (app/engine/backend.py): a quarter of the "
        "RAM beside the weights on a CPU, half of the GPU's memory beside them on a GPU, at least 1 GiB; startup "
        "logs the choice."))
    kv_format: str = setting("auto", (
        "How stored KV caches are kept: auto = per model, the fewest bytes that keep its answers faithful (top-1 "
        "agreement with float KV >= 98%, perplexity within 1%), measured once per model "
        "(app/engine/calibration.py); or a format for every model (docs/kv-formats.md: q4r, q4c, k5c, k6v4, k8v4, "
        "q8, f16, f32). Part of the model fingerprint: changing it makes existing caches a clean miss."))
    kv_formats: dict[str, str] = setting(dict, (
        "A format (or auto) for some models, over kv_format: model name -> format. In TOML a table "
        "(`[kv_formats]` then `gemma3-270m = \"q8\"`); in the environment or a flag "
        "`gemma3-270m=q8,smollm2-135m-instruct=auto`."))
    max_conversations: int = setting(8, (
        "Conversation caches an agent keeps (memory and disk); beyond it the least recently used one's cache is "
        "deleted (its history stays)."))
    cache_ttl_seconds: int = setting(24 * 3600, (
        "Seconds an agent's conversation caches stay on disk after the agent's last access, for agents that set no "
        "TTL of their own (the worker's expire job makes them cold after that)."))
    log_retention_days: int = setting(30, (
        "Days the requests and job_runs tables keep a row (the worker's prune job). A request row that a stored "
        "message or response points to stays: history is never pruned."))
    disk_budget_bytes: int = setting(20 * 1024**3, (
        "Bytes of cache files on disk (the warm tier); the worker's evict job makes the least recently used caches "
        "cold until they fit."))
    api_key: str = setting("", (
        "When set, every API request must carry it (x-api-key or Authorization: Bearer). Required to serve a "
        "non-loopback address (host 0.0.0.0, a LAN address). Prefer the variable or the file to the flag: other "
        "users of the machine can read a command line."))
    insecure_no_auth: bool = setting(False, (
        "Serve a non-loopback address without api_key anyway: anyone who can reach the port reads and changes "
        "every agent's history."))
    allowed_origins: str = setting("", (
        "Web page origins allowed to call the API besides loopback ones (comma-separated, e.g. "
        "https://chat.example.com; * = any). Requests from other origins get 403."))
    allowed_hosts: str = setting("", (
        "Host names this server answers to besides loopback and its bind address (comma-separated; * = any): the "
        "guard against DNS rebinding. On a non-loopback bind the machine's own names and addresses, private "
        "addresses and *.local / *.internal names are accepted too."))
    server_id: str = setting("", (
        "This server's name in a pool: every response carries it as x-semantic-server, and the store records it "
        "as the owner of the caches it holds. Empty: <hostname>-<port>."))
    database_url: str = setting("", (
        "The store: empty = SQLite in $SEMANTIC_HOME/semantic.db (one server); a PostgreSQL URL "
        "(postgresql://user:password@host:port/database) for a pool of servers sharing it."))
    block_store: str = setting("", (
        "A pool's shared block tier: empty = each server's own disk only; an S3 bucket "
        "(s3://bucket/prefix?endpoint=http://host:port, credentials from the AWS_* variables) that every server "
        "writes its caches through to and restores them from."))
    db_busy_timeout_s: float = setting(10.0, (
        "Seconds a database write waits for another writer's lock (SQLite busy timeout) before it is retried (a "
        "turn's history: 4 attempts) or answered with 503."))
    max_body_bytes: int = setting(32 * 1024 * 1024, (
        "Largest accepted request body: larger ones get 413 in the protocol's shape; one that announces more than "
        "this plus 1 MiB is refused by waitress before it is read."))
    idle_timeout_s: int = setting(60, (
        "Seconds a connection may sit idle (no request in progress, nothing received) before it is closed: a "
        "client that opens sockets and sends nothing holds none for long."))
    max_connections: int = setting(100, (
        "Connections open at once (waitress stops accepting beyond it). Expose the server through a reverse proxy "
        "with its own limits (docs/apis.md, \"Auth and limits\")."))
    blas_library: str = setting("", "OpenBLAS library to load before MLX: a path, empty = search, none = don't.")
    log_level: str = setting("INFO", "Logging level (DEBUG, INFO, WARNING, ERROR).")
    log_format: str = setting("text", (
        "How log lines look: text (time, level, logger, message) or json (one object a line: time, level, logger, "
        "message, and a request's fields: method, path, status, request_id, agent, client)."))
    compact_dirs: str = setting("", (
        "More block directories the worker's compact cleans besides this home's (glob patterns, comma-separated): "
        "in a pool, the servers' homes on this machine, whose copies of each other's files nothing else deletes "
        "(`pool up` sets it)."))
    janitor_interval_s: int = setting(600, (
        "Seconds between the server's janitor sweeps of its own blocks directory (quarantined files past "
        "quarantine_retention_days, files no row names, and in a pool the least recently used files the shared tier "
        "holds beyond local_disk_budget_bytes); 0 = no janitor."))
    quarantine_retention_days: int = setting(7, (
        "Days a damaged cache file stays under blocks/quarantine/ for inspection before the server's janitor "
        "deletes it."))
    local_disk_budget_bytes: int = setting(0, (
        "In a pool with a shared tier: bytes of cache files this server keeps on its own disk; beyond it the "
        "janitor deletes the least recently used files the tier holds (fetched copies, and its own once uploaded). "
        "0 = disk_budget_bytes."))
    worker: bool = setting(True, (
        "`semantic serve` runs the Huey worker (expire, evict, compact, prune) as its child; false when the worker "
        "is supervised on its own (`semantic worker`)."))

    @property
    def effective_server_id(self) -> str:
        return self.server_id or f"{socket.gethostname()}-{self.port}"

    @property
    def db_path(self) -> Path:
        return self.home / "semantic.db"

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.db_path}"

    @property
    def huey_path(self) -> Path:
        return self.home / "huey.db"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def blocks_dir(self) -> Path:
        return self.home / "blocks"

    @property
    def request_options(self) -> RequestOptions:
        return RequestOptions(self.max_output_tokens, self.default_temperature, self.default_max_tokens,
                              self.stable_prompts)

    def kv_format_for(self, model: str) -> str:
        """The stored KV format asked for ``model``: a format's name, or "auto"."""
        return self.kv_formats.get(model, self.kv_format)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_TABLES = {"model_aliases": ("alias", "model"), "kv_formats": ("model", "format")}


def _table(name: str, value: Any) -> dict[str, str]:
    """``{"alias": "model"}`` from a TOML table or from ``"alias=model,alias2=model2"``
    (``kv_formats``: ``model=format``)."""
    key, target = _TABLES[name]
    if isinstance(value, str):
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        if any(not sep or not k.strip() or not v.strip() for k, sep, v in pairs):
            raise ConfigError(f"{name}: expected {key}={target} pairs separated by commas, got {value!r}")
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                              for k, v in value.items()):
        raise ConfigError(f"{name}: expected a table of {key} = \"{target}\" strings, got {value!r}")
    return dict(value)


def _coerce(name: str, kind: Any, value: Any) -> Any:
    if kind == dict[str, str]:
        return _table(name, value)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected a boolean, got {value!r}")
        if kind is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if kind is Path:
            return Path(text).expanduser()
        if kind is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if kind is Path and isinstance(value, str):
        return Path(value).expanduser()
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}: expected a boolean, got {value!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and not isinstance(value, float):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


_KINDS: dict[str, Any] = get_type_hints(Settings)


def settings_kinds() -> dict[str, Any]:
    """Each setting's type: ``{"port": int, "home": Path, "model_aliases": dict[str, str], ...}``."""
    return dict(_KINDS)


def variable_of(name: str) -> str:
    """The environment variable of a setting: ``port`` -> ``SEMANTIC_PORT``."""
    return f"SEMANTIC_{name.upper()}"


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{key}={target}" for key, target in value.items())
    return str(value)


def as_environment(settings: Settings) -> dict[str, str]:
    """Every setting as its ``SEMANTIC_*`` variable: a child process given them (the worker of
    ``semantic serve``) has these settings, the command line's flags included."""
    return {variable_of(name): _as_text(value) for name, value in settings.as_dict().items()}

_YEAR_S = 365 * 24 * 3600
# The range each numeric setting must fall in (inclusive): a zero or negative count, or a
# duration no clock can add, is a configuration mistake to name at start, not later.
BOUNDS: dict[str, tuple[float, float]] = {
    "port": (1, 65535),
    "default_temperature": (0.0, 2.0),
    "repetition_penalty": (0.5, 2.0),
    "max_output_tokens": (1, 1 << 24),
    "default_max_tokens": (1, 1 << 24),
    "prefill_step_size": (0, 1 << 16),  # 0: per backend
    "speculative_tokens": (0, 64),
    "max_batch": (1, 256),
    "max_queue": (1, 1 << 16),
    "threads": (2, 1024),
    "cache_memory_bytes": (0, 1 << 50),  # 0: from the machine
    "max_conversations": (1, 1 << 16),
    "cache_ttl_seconds": (1, 100 * _YEAR_S),
    "disk_budget_bytes": (0, 1 << 60),
    "db_busy_timeout_s": (0.001, 3600.0),
    "max_body_bytes": (1024, 1 << 31),
    "idle_timeout_s": (1, 24 * 3600),
    "max_connections": (4, 1 << 16),
    "log_retention_days": (1, 36500),
    "janitor_interval_s": (0, 7 * 24 * 3600),
    "quarantine_retention_days": (1, 36500),
    "local_disk_budget_bytes": (0, 1 << 60),
}


def config_file(env: Mapping[str, str], home: str | Path | None = None) -> Path | None:
    """The TOML file that applies, if any; ``home``: the home a flag named (over SEMANTIC_HOME)."""
    if env.get("SEMANTIC_CONFIG"):
        return Path(env["SEMANTIC_CONFIG"]).expanduser()
    named = home or env.get("SEMANTIC_HOME")
    candidate = (Path(named).expanduser() if named else Settings().home) / "config.toml"
    return candidate if candidate.exists() else None


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build the effective settings: defaults < TOML file < environment < overrides.

    Raises:
        ConfigError: an unknown key in the file or a value of the wrong type.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file(env, overrides.get("home"))
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        unknown = sorted(set(data) - set(_KINDS))
        if unknown:
            raise ConfigError(f"{path}: unknown settings {', '.join(unknown)}")
        values.update(data)
    for name in _KINDS:
        variable = variable_of(name)
        if variable in env:
            values[name] = env[variable]
    values.update({k: v for k, v in overrides.items() if v is not None})
    typed = {name: _coerce(name, _KINDS[name], value) for name, value in values.items()}
    settings = Settings(**typed)
    requested = {"kv_format": settings.kv_format, **{f"kv_formats: {m}": f for m, f in settings.kv_formats.items()}}
    for where, kv_format in requested.items():
        if kv_format not in ("auto", *KV_FORMAT_NAMES):
            raise ConfigError(f"{where}: {kv_format!r} is not auto or one of {', '.join(KV_FORMAT_NAMES)}")
    if settings.log_format not in ("text", "json"):
        raise ConfigError(f"log_format: {settings.log_format!r} is not text or json")
    for name, (low, high) in BOUNDS.items():
        value = getattr(settings, name)
        if not low <= value <= high:
            raise ConfigError(f"{name}: {value} is outside {low:g}..{high:g}")
    return dataclasses.replace(settings, home=settings.home.expanduser())
