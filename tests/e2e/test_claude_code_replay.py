"""What the real Claude Code CLI sends, recorded and replayed against a real server.

The pinned CLI runs headless against a scripted stand-in (tests/support/claude_recorder.py)
in a git repository with its full default tool set (no ``--tools``): turn 1 runs ``ls``
with Bash; a file changes (so the CLI's git status snapshot changes); turn 2 (``-c``)
starts a subagent with the Agent tool, whose request carries the main session's id and
arrives between two main requests, then the main conversation continues with its result.
The recorded requests are replayed in that order, as the CLI sent them (headers, system
blocks, tools, metadata), each assistant turn replaced by what the server answered.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest

from support.servers import ServerProcess, claude_env, start_server, stop_server
from support.claude_recorder import Recorded, is_subagent, record_headless_session
from support.dbcheck import query

REPLAY_MAX_TOKENS = 16
KEPT_HEADERS = ("X-Claude-Code-Session-Id", "anthropic-beta", "anthropic-version", "x-app", "User-Agent")


@pytest.fixture(scope="module")
def recorded(claude: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Recorded]:
    work, home = tmp_path_factory.mktemp("repo"), tmp_path_factory.mktemp("claude-home")
    return record_headless_session(claude, work, home, claude_env("", home))


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    running = start_server(tmp_path_factory.mktemp("replay"), smollm2_dir,
                           {"SEMANTIC_DEFAULT_TEMPERATURE": "0", "SEMANTIC_REPETITION_PENALTY": "1.3"})
    yield running
    stop_server(running)


def replay(server: ServerProcess, requests: list[Recorded]) -> list[tuple[str, anthropic.types.Message]]:
    """Send the recorded requests in order; a conversation's earlier assistant turn is the
    server's own answer (as the CLI would have resent it), the rest is as recorded."""
    client = anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)
    state: dict[str, tuple[int, list[dict[str, Any]], dict[str, Any]]] = {}
    answers = []
    for request in requests:
        body = copy.deepcopy(request.body)
        name = "subagent" if is_subagent(body) else "main"
        if name in state:
            n_recorded, sent, reply = state[name]
            body["messages"] = [*sent, reply, *body["messages"][n_recorded + 1:]]
        headers = {k: v for k, v in request.headers.items() if k in KEPT_HEADERS}
        rest = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens", "stream")}
        with client.messages.stream(model=body["model"], messages=body["messages"], max_tokens=REPLAY_MAX_TOKENS,
                                    extra_body=rest, extra_headers=headers) as stream:
            message = stream.get_final_message()
        answers.append((name, message))
        reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        state[name] = (len(request.body["messages"]), body["messages"], reply)
    return answers


def read_share(message: anthropic.types.Message) -> float:
    u = message.usage
    return u.cache_read_input_tokens / (u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def test_the_recorded_session_has_the_shapes_the_cli_sends(recorded: list[Recorded]) -> None:
    names = ["subagent" if is_subagent(r.body) else "main" for r in recorded]
    assert names == ["main", "main", "main", "subagent", "main"]
    sessions = {r.headers["X-Claude-Code-Session-Id"] for r in recorded}
    assert len(sessions) == 1  # the subagent shares the main session's id
    assert len(recorded[0].body["tools"]) > 20  # the full default tool set
    snapshots = [r.body["system"][-1]["text"].split("gitStatus:")[1] for r in recorded if not is_subagent(r.body)]
    assert snapshots[0] != snapshots[-1]  # turn 2 came with a new git status


def test_replayed_session_reads_from_cache_and_keeps_each_conversation(recorded: list[Recorded],
                                                                        replay_server: ServerProcess) -> None:
    answers = replay(replay_server, recorded)
    session = recorded[0].headers["X-Claude-Code-Session-Id"]
    # The full tool set fits the embedded model's 8K context once the auto memory section is dropped.
    assert "fitted to the context: optional sections dropped" in replay_server.log()
    for i, (name, message) in enumerate(answers):
        if i and name == "main":  # every main request after the first, across the git change and the subagent
            assert read_share(message) >= 0.95, (i, message.usage)
    rows = query(replay_server.db_path, "SELECT conversation_id, reuse_reason, diverge_part FROM requests "
                 "WHERE agent_id = ? ORDER BY created_at", session)
    assert len(rows) == len(recorded) and all(reason for _, reason, _ in rows)  # every request says how reuse ended
    main, sub = rows[0][0], rows[3][0]
    assert main != sub and {c for c, _, _ in rows} == {main, sub}
    assert rows[3][1] in ("miss", "sibling", "shared") and rows[3][2] == "system"  # parted from main in the system
    history = query(replay_server.db_path, "SELECT conversation_id, position, role FROM messages WHERE agent_id = ? "
                    "ORDER BY conversation_id, position", session)
    main_roles = [role for c, _, role in history if c == main]
    assert len(main_roles) == len(recorded[-1].body["messages"]) + 1 and main_roles[-1] == "assistant"
    assert [role for c, _, role in history if c == sub] == [m["role"] for m in recorded[3].body["messages"]] + \
        ["assistant"]
