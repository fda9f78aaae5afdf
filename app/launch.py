"""`semantic launch claude|codex [-- ARGS]`: run an agent CLI pointed at this home's server.

Claude Code takes its server from the environment (``ANTHROPIC_BASE_URL``, a key, and the
switches that keep it from contacting any other host: the design notes' CLAUDE_CODE.md).
Codex takes it from a provider in ``config.toml``: launch keeps a ``CODEX_HOME`` of its own
under this home (``$SEMANTIC_HOME/clients/codex``), its ``config.toml`` rewritten at each
launch, so Codex's sessions (``codex resume --last``) persist between launches and the
user's own ``~/.codex`` is left alone. ``--print`` shows what would run instead of running it.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from app.errors import ConfigError

CLIENTS = ("claude", "codex")
INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "codex": "npm install -g @openai/codex"}
CODEX_PROVIDER = "semantic"
CODEX_KEY_VARIABLE = "SEMANTIC_API_KEY"  # the variable Codex reads the key from (env_key)
# Claude Code contacts nothing but ANTHROPIC_BASE_URL with these (no telemetry, updates, error reports).
CLAUDE_QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1"}
# A local model's prefill of a long prompt can take many minutes. Claude Code (2.1.197, read in
# its binary) gives a request 600 s in all by default (API_TIMEOUT_MS) and a stream 300 s
# without a byte (CLAUDE_STREAM_IDLE_TIMEOUT_MS; its floor): an hour each.
CLAUDE_PATIENT = {"API_TIMEOUT_MS": "3600000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000"}
CLAUDE_OUTPUT_TOKENS = "CLAUDE_CODE_MAX_OUTPUT_TOKENS"


@dataclass(frozen=True)
class Launch:
    """What runs: the program, its arguments, the variables set for it and a file written first."""

    argv: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    config_path: Path | None = None
    config_text: str = ""

    def shown(self) -> str:
        """The launch as shell lines (the key masked)."""
        lines = []
        if self.config_path is not None:
            lines.append(f"# {self.config_path}\n{self.config_text}")
        variables = " ".join(f"{k}={shlex.quote('***' if k in _SECRET_VARIABLES and v != 'unused' else v)}"
                             for k, v in self.env.items())
        lines.append(f"{variables} {shlex.join(self.argv)}")
        return "\n".join(lines)


_SECRET_VARIABLES = {"ANTHROPIC_API_KEY", CODEX_KEY_VARIABLE}


def codex_config(base_url: str, model: str) -> str:
    """Codex's provider: the Responses API over its WebSocket transport (each request sends only
    its new items: docs/responses-api.md)."""
    return (f'model = "{model}"\nmodel_provider = "{CODEX_PROVIDER}"\n\n[model_providers.{CODEX_PROVIDER}]\n'
            f'name = "Semantic"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\n'
            f'env_key = "{CODEX_KEY_VARIABLE}"\nsupports_websockets = true\n')


def output_tokens(context_length: int) -> int:
    """Claude Code's reply budget (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``) for a served context: a
    16th of it, 256 to 8,192 tokens (Claude Code asks for 32,000: a small model wrote until
    its 8K context was full, and the next request did not fit)."""
    return max(256, min(8192, context_length // 16))


def plan(client: str, url: str, home: Path, api_key: str | None, model: str | None, args: list[str],
         binary: str | None = None, context_length: int | None = None) -> Launch:
    """The launch of ``client`` against the server at ``url`` (``context_length``: the served
    model's, which sizes Claude Code's reply budget unless the caller's environment sets one).

    Raises:
        ConfigError: the client is unknown or not installed.
    """
    if client not in CLIENTS:
        raise ConfigError(f"launch: unknown client {client!r} (one of {', '.join(CLIENTS)})")
    found = binary or shutil.which(client)
    if found is None:
        raise ConfigError(f"{client} is not on the PATH: {INSTALL[client]}, or give its path with --bin")
    key = api_key or "unused"
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, **CLAUDE_QUIET, **CLAUDE_PATIENT,
               **({"ANTHROPIC_MODEL": model} if model else {})}
        if context_length and CLAUDE_OUTPUT_TOKENS not in os.environ:
            env[CLAUDE_OUTPUT_TOKENS] = str(output_tokens(context_length))
        return Launch([found, *args], env)
    codex_home = home / "clients" / "codex"
    return Launch([found, *args], {"CODEX_HOME": str(codex_home), CODEX_KEY_VARIABLE: key},
                  codex_home / "config.toml", codex_config(url, model or "default"))


def run(launch: Launch) -> None:
    """Write the launch's configuration, then become the client (this process is replaced:
    its exit status and Ctrl-C are the client's own)."""
    if launch.config_path is not None:
        launch.config_path.parent.mkdir(parents=True, exist_ok=True)
        launch.config_path.write_text(launch.config_text)
    os.execve(launch.argv[0], launch.argv, {**os.environ, **launch.env})
