"""Settings: defaults, overridden by a TOML file, by ``SEMANTIC_*`` variables, by ``serve`` flags.

Read once at process start (``load_settings``) and passed down; nothing below reads the
environment (``Settings(...)`` is its arguments over the defaults). The TOML file is
``$SEMANTIC_CONFIG`` if set, else ``config.toml`` in the home (``--home``, ``$SEMANTIC_HOME``) if
it exists. Its keys are the field names below (``port = 8080``); the variable for a field is
``SEMANTIC_`` + its upper-case name (``SEMANTIC_PORT=8080``), its flag ``--port``
(``app/setting_flags.py``, made from each field's type, description, default and range).
A pydantic-settings model: pydantic checks each value against its field's type, range
(``ge``, ``le``) and validators; ``load_settings`` names the first failure in one line.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.errors import ConfigError
from app.types import KV_FORMAT_NAMES, RequestOptions

DEFAULT_MODEL = "qwen2.5-coder-1.5b"  # why: README, "The model it serves"
_YEAR_S = 365 * 24 * 3600
_KV_FORMATS = ("auto", *KV_FORMAT_NAMES)
_Source = PydanticBaseSettingsSource


class Settings(BaseSettings):
    """Every setting of Semantic, with its default and, for a number, the range it must fall in
    (inclusive): a zero or negative count, or a duration no clock can add, is a configuration
    mistake to name at start, not later. Reference: docs/configuration.md (tests/unit/test_docs.py
    keeps it in step)."""

    # A dict's variable is text (``a=b,c=d``), not JSON; ``SEMANTIC_`` + the name in upper case.
    model_config = SettingsConfigDict(frozen=True, enable_decoding=False, env_prefix="SEMANTIC_")

    home: Path = Field(default_factory=lambda: Path.home() / ".semantic", description=(
        "Where the database, the models and the cache files live."))
    host: str = Field("127.0.0.1", description=(
        "Bind address (localhost only by default); any other address needs api_key, or insecure_no_auth."))
    port: int = Field(8000, ge=1, le=65535, description="TCP port.")
    model: str = Field(DEFAULT_MODEL, description=(
        "The model served: a name under $SEMANTIC_HOME/models, a directory path, or a Hugging Face repo id "
        "(org/name) found offline in the Hugging Face cache (HF_HUB_CACHE, HF_HOME)."))
    model_aliases: dict[str, str] = Field(default_factory=dict, description=(
        "Names a request's `model` may use for installed models: alias -> model name (or directory). In TOML a "
        "table (`[model_aliases]` then `fast = \"smollm2-4bit\"`); in the environment or a flag "
        "`fast=smollm2-4bit,big=gemma3-270m`. A request naming another model than the loaded one makes the engine "
        "swap models."))
    map_unknown_models: bool = Field(True, description=(
        "Serve request model names (e.g. claude-sonnet-5, which Claude Code sends) that are neither installed "
        "models nor aliases with `model` (logged once per name); false answers them with 404 naming the models "
        "served. An installed model's name is never answered by another model."))
    serve_installed_models: bool = Field(True, description=(
        "Let requests name any model installed under $SEMANTIC_HOME/models or in the Hugging Face cache, not only "
        "`model` and the aliases' targets: the engine swaps it in, as Ollama loads the model a request names. "
        "Each swap reloads the model and sends every conversation's cache to disk: on a shared server, clients "
        "alternating two names would thrash them all; false answers an installed model's name with 404 (never "
        "with another model)."))
    dtype: str = Field("auto", description=(
        "Compute dtype: auto = float32 on CPU (fast BLAS path), the model's own elsewhere."))
    default_temperature: float = Field(1.0, ge=0.0, le=2.0, description=(
        "Temperature for requests that name none (Anthropic and OpenAI default to 1.0; small models given a long "
        "agent prompt ramble at 1.0 and stop sooner at 0)."))
    repetition_penalty: float = Field(1.0, ge=0.5, le=2.0, description=(
        "Multiplicative penalty on the last 20 tokens' logits (1.0 = off); small models under long agent prompts "
        "fall into loops without it."))
    speculative_tokens: int = Field(8, ge=0, le=64, description=(
        "The longest speculative draft, in tokens: requests guess the next tokens from the conversation "
        "(prompt-lookup n-grams) and the model checks them in one forward pass, with the same output token for "
        "token when greedy and the same distribution when sampling. 0 = off; on an NVIDIA GPU off unless set "
        "(or a draft_model is): slower there. A request turns drafts off with speculate false."))
    draft_model: str = Field("", description=(
        "A smaller model that drafts instead of prompt lookup: a name, a directory or a Hugging Face repo id, as "
        "model takes them, sharing the served model's vocabulary (Llama 3.2 1B for Llama 3.1 8B). The output is "
        "the same; each draft token costs one of its forward passes. Empty = drafts from the conversation."))
    max_output_tokens: int = Field(131072, ge=1, le=1 << 24, description=(
        "Upper bound for a request's max_tokens; larger values are a 400."))
    default_max_tokens: int = Field(512, ge=1, le=1 << 24, description=(
        "Output bound of requests that set none (OpenAI may omit max_tokens; the direct API too)."))
    stable_prompts: bool = Field(True, description=(
        "Make what Claude Code's prompts change between requests stable (billing header dropped, tools sorted, the "
        "git status snapshot pinned per conversation): app/protocol/claude_code.py."))
    fit_prompts: bool = Field(True, description=(
        "A prompt beyond the context drops optional sections (Claude Code's auto memory instructions) before it is "
        "refused as too long."))
    prefill_step_size: int = Field(0, ge=0, le=1 << 16, description=(
        "The largest prefill chunk in tokens (bounds peak memory on long prompts): a prompt prefilling alone takes "
        "chunks of this size; while other requests run, chunks are sized to take about 0.25 s so that none waits "
        "long. 0 = per backend (app/engine/backend.py): 256 on a CPU, 2048 on a GPU; startup logs the choice."))
    prefill_checkpoint_s: float = Field(30.0, ge=0, le=3600, description=(
        "A prefill still under way after this many seconds stores what it has computed so far (its blocks in "
        "memory and on disk, as a finished turn's), again every as many seconds: a process killed during a long "
        "prefill keeps them, and the same prompt resumes from there after the restart. 0 = only when the prefill "
        "ends or is cancelled."))
    max_batch: int = Field(8, ge=1, le=256, description=(
        "Generations the engine runs at once (prefilling or decoding, in one batch)."))
    max_queue: int = Field(16, ge=1, le=1 << 16, description=(
        "Requests waiting for a place in the batch before new ones get 429."))
    max_queue_wait_s: float = Field(300.0, ge=1, le=86400, description=(
        "Seconds a request may wait in the queue for a place in the batch (behind a long prefill, or beside "
        "generations that fill the memory budget) before it gets 429, with a retry-after estimated from the "
        "pace turns end at (a stream gets its protocol's error event)."))
    threads: int = Field(32, ge=2, le=1024, description=(
        "Waitress worker threads (each streaming response holds one): more than max_batch + max_queue, so a full "
        "engine answers 429 and /health still answers."))
    split_cores: bool = Field(True, description=(
        "With several sequences decoding on a CPU with OpenBLAS, split each step over both cores (half of every "
        "projection and of the rows' attention on a second MLX stream, OpenBLAS on one thread) for more "
        "aggregate tok/s. See app/engine/cores.py."))
    cache_reuse: bool = Field(True, description="Reuse KV caches across turns (false: every prompt is prefilled cold).")
    cache_memory_bytes: int = Field(0, ge=0, le=1 << 50, description=(
        "Bytes of KV cache kept in memory (the hot tier): the stored blocks, plus the float working copies of the "
        "4 most recent conversations; the rest waits on disk. It bounds the running generations' working caches "
        "too, and a draft_model's. 0 = from the machine (app/engine/backend.py): a quarter of the RAM beside the "
        "weights on a CPU, half of the GPU's memory beside them on a GPU, at least 1 GiB; startup logs the choice."))
    kv_format: str = Field("auto", description=(
        "How stored KV caches are kept: auto = per model, the fewest bytes that keep its answers faithful (top-1 "
        "agreement with float KV >= 98%, perplexity within 1%), measured once per model "
        "(app/engine/calibration.py); or a format for every model (docs/kv-formats.md: q4r, q4c, k5c, k6v4, k8v4, "
        "q8, f16, f32). Part of the model fingerprint: changing it makes existing caches a clean miss."))
    kv_formats: dict[str, str] = Field(default_factory=dict, description=(
        "A format (or auto) for some models, over kv_format: model name -> format. In TOML a table "
        "(`[kv_formats]` then `gemma3-270m = \"q8\"`); in the environment or a flag "
        "`gemma3-270m=q8,smollm2-135m-instruct=auto`."))
    max_conversations: int = Field(8, ge=1, le=1 << 16, description=(
        "Conversation caches an agent keeps (memory and disk); beyond it the least recently used one's cache is "
        "deleted (its history stays)."))
    cache_ttl_seconds: int = Field(24 * 3600, ge=1, le=100 * _YEAR_S, description=(
        "Seconds an agent's conversation caches stay on disk after the agent's last access, for agents that set no "
        "TTL of their own (the worker's expire job makes them cold after that)."))
    log_retention_days: int = Field(30, ge=1, le=36500, description=(
        "Days the requests and job_runs tables keep a row (the worker's prune job). A request row that a stored "
        "message or response points to stays: history is never pruned."))
    disk_budget_bytes: int = Field(20 * 1024**3, ge=0, le=1 << 60, description=(
        "Bytes of cache files on disk (the warm tier); the worker's evict job makes the least recently used caches "
        "cold until they fit."))
    api_key: str = Field("", description=(
        "When set, every API request must carry it (x-api-key or Authorization: Bearer). Required to serve a "
        "non-loopback address (host 0.0.0.0, a LAN address). Prefer the variable or the file to the flag: other "
        "users of the machine can read a command line."))
    insecure_no_auth: bool = Field(False, description=(
        "Serve a non-loopback address without api_key anyway: anyone who can reach the port reads and changes "
        "every agent's history."))
    allowed_origins: str = Field("", description=(
        "Web page origins allowed to call the API besides loopback ones (comma-separated, e.g. "
        "https://chat.example.com; * = any). Requests from other origins get 403."))
    allowed_hosts: str = Field("", description=(
        "Host names this server answers to besides loopback and its bind address (comma-separated; * = any): the "
        "guard against DNS rebinding. On a non-loopback bind the machine's own names and addresses, private "
        "addresses and *.local / *.internal names are accepted too."))
    server_id: str = Field("", description=(
        "This server's name in a pool: every response carries it as x-semantic-server, and the store records it "
        "as the owner of the caches it holds. Empty: <hostname>-<port>."))
    database_url: str = Field("", description=(
        "The store: empty = SQLite in $SEMANTIC_HOME/semantic.db (one server); a PostgreSQL URL "
        "(postgresql://user:password@host:port/database) for a pool of servers sharing it."))
    block_store: str = Field("", description=(
        "A pool's shared block tier: empty = each server's own disk only; an S3 bucket "
        "(s3://bucket/prefix?endpoint=http://host:port, credentials from the AWS_* variables) that every server "
        "writes its caches through to and restores them from."))
    db_busy_timeout_s: float = Field(10.0, ge=0.001, le=3600.0, description=(
        "Seconds a database write waits for another writer's lock (SQLite busy timeout) before it is retried (a "
        "turn's history: 4 attempts) or answered with 503."))
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=1 << 31, description=(
        "Largest accepted request body: larger ones get 413 in the protocol's shape; one that announces more than "
        "this plus 1 MiB is refused by waitress before it is read."))
    idle_timeout_s: int = Field(60, ge=1, le=24 * 3600, description=(
        "Seconds a connection may sit idle (no request in progress, nothing received) before it is closed: a "
        "client that opens sockets and sends nothing holds none for long."))
    max_connections: int = Field(100, ge=4, le=1 << 16, description=(
        "Connections open at once (waitress stops accepting beyond it). Expose the server through a reverse proxy "
        "with its own limits (docs/apis.md, \"Auth and limits\")."))
    max_websockets: int = Field(32, ge=1, le=1 << 14, description=(
        "Responses API WebSocket connections open at once (each holds two threads; an upgrade beyond it gets 429). "
        "Counted apart from max_connections; both are closed after idle_timeout_s without a message."))
    blas_library: str = Field("", description=(
        "OpenBLAS library to load before MLX: a path, empty = search, none = don't."))
    log_level: str = Field("INFO", description="Logging level (DEBUG, INFO, WARNING, ERROR).")
    log_format: str = Field("text", description=(
        "How log lines look: text (time, level, logger, message) or json (one object a line: time, level, logger, "
        "message, and a request's fields: method, path, status, request_id, agent, client)."))
    compact_dirs: str = Field("", description=(
        "More block directories the worker's compact cleans besides this home's (glob patterns, comma-separated): "
        "in a pool, the servers' homes on this machine, whose copies of each other's files nothing else deletes "
        "(`pool up` sets it)."))
    janitor_interval_s: int = Field(600, ge=0, le=7 * 24 * 3600, description=(
        "Seconds between the server's janitor sweeps of its own blocks directory (quarantined files past "
        "quarantine_retention_days, files no row names, and in a pool the least recently used files the shared tier "
        "holds beyond local_disk_budget_bytes); 0 = no janitor."))
    quarantine_retention_days: int = Field(7, ge=1, le=36500, description=(
        "Days a damaged cache file stays under blocks/quarantine/ for inspection before the server's janitor "
        "deletes it."))
    local_disk_budget_bytes: int = Field(0, ge=0, le=1 << 60, description=(
        "In a pool with a shared tier: bytes of cache files this server keeps on its own disk; beyond it the "
        "janitor deletes the least recently used files the tier holds (fetched copies, and its own once uploaded). "
        "0 = disk_budget_bytes."))
    worker: bool = Field(True, description=(
        "`semantic serve` runs the Huey worker (expire, evict, compact, prune) as its child; false when the worker "
        "is supervised on its own (`semantic worker`)."))

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: _Source, env_settings: _Source,
                                   dotenv_settings: _Source, file_secret_settings: _Source) -> tuple[_Source, ...]:
        return (init_settings,)  # Settings(...) reads nothing; load_settings adds the file and the variables

    @field_validator("*", mode="before")
    @classmethod
    def _plain(cls, value: Any, info: ValidationInfo) -> Any:
        """A number's, a switch's or a path's text may have spaces around it (``" true "``); a
        switch is no number and a number no switch (``port = true``, ``worker = 1`` in TOML)."""
        kind = cls.model_fields[info.field_name or ""].annotation
        if kind in (int, float, bool) and not isinstance(value, str) and isinstance(value, bool) != (kind is bool):
            raise PydanticCustomError(f"{kind.__name__}_type", "not a {kind}", {"kind": kind.__name__})
        return value.strip() if isinstance(value, str) and kind in (int, float, bool, Path) else value

    @field_validator("model_aliases", "kv_formats", mode="before")
    @classmethod
    def _table(cls, value: Any, info: ValidationInfo) -> dict[str, str]:
        """``{"alias": "model"}`` from a TOML table or from ``"alias=model,alias2=model2"``
        (``kv_formats``: ``model=format``)."""
        key, target = ("alias", "model") if info.field_name == "model_aliases" else ("model", "format")
        if isinstance(value, str):
            pairs = [item.partition("=") for item in value.split(",") if item.strip()]
            if any(not sep or not k.strip() or not v.strip() for k, sep, v in pairs):
                raise ValueError(f"expected {key}={target} pairs separated by commas, got {value!r}")
            value = {k.strip(): v.strip() for k, _, v in pairs}
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                  for k, v in value.items()):
            raise ValueError(f"expected a table of {key} = \"{target}\" strings, got {value!r}")
        return dict(value)

    @field_validator("kv_format", "kv_formats")
    @classmethod
    def _kv_formats(cls, value: Any, info: ValidationInfo) -> Any:
        """A format's name, or auto; ``kv_formats``: each model's."""
        for where, kv_format in ({"": value} if info.field_name == "kv_format" else value).items():
            if kv_format not in _KV_FORMATS:
                raise ValueError(f"{where + ': ' if where else ''}{kv_format!r} is not auto or one of "
                                 f"{', '.join(KV_FORMAT_NAMES)}")
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("text", "json"):
            raise ValueError(f"{value!r} is not text or json")
        return value

    @field_validator("home")
    @classmethod
    def _home(cls, value: Path) -> Path:
        return value.expanduser()

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
        return dict(self)


# The range of each numeric setting, from its field's ``ge`` and ``le``: {"port": (1, 65535), ...}.
BOUNDS: dict[str, tuple[float, float]] = {
    name: (next(m.ge for m in item.metadata if hasattr(m, "ge")), next(m.le for m in item.metadata if hasattr(m, "le")))
    for name, item in Settings.model_fields.items() if any(hasattr(m, "ge") for m in item.metadata)}


def settings_kinds() -> dict[str, Any]:
    """Each setting's type: ``{"port": int, "home": Path, "model_aliases": dict[str, str], ...}``."""
    return {name: item.annotation for name, item in Settings.model_fields.items()}


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


def config_file(env: Mapping[str, str], home: str | Path | None = None) -> Path | None:
    """The TOML file that applies, if any; ``home``: the home a flag named (over SEMANTIC_HOME)."""
    if env.get("SEMANTIC_CONFIG"):
        return Path(env["SEMANTIC_CONFIG"]).expanduser()
    named = home or env.get("SEMANTIC_HOME")
    candidate = (Path(named).expanduser() if named else Settings().home) / "config.toml"
    return candidate if candidate.exists() else None


class _Variables(EnvSettingsSource):
    """The ``SEMANTIC_*`` variables of ``env`` (``os.environ``, or the mapping a caller passes),
    spelled exactly so: upper case."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._env.items() if name.isupper()}


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "a boolean", "string": "a string", "path": "a path"}


def _one_line(error: ErrorDetails) -> str:
    """``port: 70000 is outside 1..65535``: a pydantic error as the setting's name and what is wrong."""
    name, kind = str(error["loc"][0]), error["type"]
    if kind in ("greater_than_equal", "less_than_equal"):
        low, high = BOUNDS[name]
        return f"{name}: {settings_kinds()[name](error['input'])} is outside {low:g}..{high:g}"
    if kind == "value_error":
        return f"{name}: {error['ctx']['error']}"
    expected = _EXPECTED.get(kind.split("_")[0])
    return f"{name}: expected {expected}, got {error['input']!r}" if expected else f"{name}: {error['msg']}"


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build the effective settings: defaults < TOML file < environment < overrides.

    Raises:
        ConfigError: an unknown key in the file, or a value of the wrong type or out of range.
    """
    env = os.environ if env is None else env
    path = config_file(env, overrides.get("home"))
    try:
        data = tomllib.loads(path.read_text()) if path is not None else {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"{path}: unknown settings {', '.join(unknown)}")
    given = {name: value for name, value in overrides.items() if value is not None}
    try:  # the first source wins
        return Settings(_build_sources=((InitSettingsSource(Settings, given), _Variables(env),
                                         InitSettingsSource(Settings, data)), given))
    except ValidationError as exc:
        raise ConfigError(_one_line(exc.errors()[0])) from None
