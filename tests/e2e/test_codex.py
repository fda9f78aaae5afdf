"""The real Codex CLI (npm, pinned) against a real server and the embedded model: one session,
two turns (``codex exec``, then ``codex exec resume --last``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT
from support.servers import ServerProcess, start_server, stop_server
from support.codex_recorder import codex_env, run_codex, write_config
from support.dbcheck import query


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    # Codex sends no temperature; greedy with a repetition penalty lets SmolLM2 end its turn.
    running = start_server(tmp_path_factory.mktemp("codex-home"), smollm2_dir,
                           {"SEMANTIC_DEFAULT_TEMPERATURE": "0", "SEMANTIC_REPETITION_PENALTY": "1.3"})
    yield running
    stop_server(running)


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _exec_then_resume(codex: Path, server: ServerProcess, tmp_path: Path,
                      websockets: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """`codex exec`, then `codex exec resume --last`: each turn's events by type. Each turn
    ended with an answer, and the CLI was told the second read at least 90% of the first
    one's prompt from cache."""
    write_config(tmp_path / "codex-home", f"{server.url}/v1", websockets=websockets)
    (tmp_path / "work").mkdir()
    env = codex_env(tmp_path / "codex-home", tmp_path)
    turns = []
    for resume, prompt in ((False, "What is 2+2?"), (True, "And 3+3?")):
        done = run_codex(codex, tmp_path / "work", env, prompt, resume)
        assert done.returncode == 0, (done.stdout, done.stderr[-3000:], server.log()[-3000:])
        turns.append(events(done.stdout))
    for turn in turns:
        assert any(e["type"] == "item.completed" and e["item"]["type"] == "agent_message" for e in turn), turn
    first, second = ({e["type"]: e for e in turn} for turn in turns)
    usage_1, usage_2 = first["turn.completed"]["usage"], second["turn.completed"]["usage"]
    assert usage_2["cached_input_tokens"] >= 0.9 * usage_1["input_tokens"]
    return first, second


@pytest.mark.timeout(1500)
def test_exec_then_resume_reads_the_first_prompt_from_cache(codex: Path, server: ServerProcess,
                                                           tmp_path: Path) -> None:
    first, second = _exec_then_resume(codex, server, tmp_path, websockets=False)
    assert first["thread.started"]["thread_id"] == second["thread.started"]["thread_id"]
    # What the server recorded: both requests in one agent (the session) and one conversation (its thread).
    session = first["thread.started"]["thread_id"]
    rows = query(server.db_path, "SELECT conversation_id, n_input_tokens, n_cached_tokens, reuse_reason, protocol "
                 "FROM requests WHERE agent_id = ? AND status = 'ok' ORDER BY created_at", session)
    assert len(rows) == 2 and rows[0][0] == rows[1][0] and {r[4] for r in rows} == {"responses"}
    (_, prompt_1, _, _, _), (_, prompt_2, cached_2, outcome_2, _) = rows
    assert cached_2 >= 0.9 * prompt_1 and outcome_2 == "extend"
    assert query(server.db_path, "SELECT thread FROM conversations WHERE id = ?", rows[0][0]) == [(session,)]


@pytest.mark.timeout(1500)
def test_over_the_websocket_each_request_sends_only_its_new_input(codex: Path, server: ServerProcess,
                                                                  tmp_path: Path) -> None:
    """``supports_websockets = true``: Codex warms each connection up (``generate: false``),
    then sends each turn as ``response.create`` with ``previous_response_id`` and only the
    items after it (store: false); a resumed session's new process opens a new connection."""
    first, _ = _exec_then_resume(codex, server, tmp_path, websockets=True)
    session = first["thread.started"]["thread_id"]
    rows = query(server.db_path, "SELECT id, conversation_id, n_input_tokens, n_cached_tokens, reuse_reason "
                 "FROM requests WHERE agent_id = ? AND status = 'ok' ORDER BY created_at", session)
    assert len(rows) == 2 and rows[0][1] == rows[1][1] and rows[1][3] >= 0.9 * rows[0][2] and rows[1][4] == "extend"
    # Both turns came over a WebSocket, each after its connection's warm-up (none over HTTP).
    log = server.log()
    for request_id, *_ in rows:
        assert re.search(rf"WebSocket \w+: request {request_id} agent {session}", log), request_id
    assert len(re.findall(r"WebSocket \w+: request \w+ warm-up", log)) >= 2
    assert not re.search(rf"POST /v1/responses \d+ request ({rows[0][0]}|{rows[1][0]})", log)


@pytest.mark.timeout(1000)
def test_semantic_launch_runs_codex_against_this_homes_server(codex: Path, server: ServerProcess,
                                                              tmp_path: Path) -> None:
    """`semantic launch codex -- ARGS`: Codex configured for the server serving the home (its
    own CODEX_HOME under the home), run with the arguments given."""
    (tmp_path / "work").mkdir()
    answered = "SELECT count(*) FROM requests WHERE protocol = 'responses' AND status = 'ok'"
    before = query(server.db_path, answered)[0][0]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SEMANTIC_HOME": str(server.home)}
    done = subprocess.run([sys.executable, "-m", "app", "launch", "codex", "--bin", str(codex), "--",
                           "exec", "--skip-git-repo-check", "--json", "What is 2+2?"],
                          cwd=tmp_path / "work", env={**env, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert any(e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
               for e in events(done.stdout)), done.stdout[-2000:]
    config = (server.home / "clients" / "codex" / "config.toml").read_text()
    assert f'base_url = "{server.url}/v1"' in config and 'wire_api = "responses"' in config
    assert "supports_websockets = true" in config
    assert query(server.db_path, answered)[0][0] > before
    (latest,) = query(server.db_path, "SELECT id FROM requests WHERE protocol = 'responses' AND status = 'ok' "
                      "ORDER BY created_at DESC LIMIT 1")[0]
    assert re.search(rf"WebSocket \w+: request {latest} agent", server.log())  # over the WebSocket
