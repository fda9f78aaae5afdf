"""Several conversations under one session id, as Claude Code sends them: each keeps its own
cache and history, side requests never evict the main conversation, and every request
records how its cache reuse ended.

Requests have Claude Code's shape (the billing-header system block, system blocks with
cache_control, tools, ``metadata.user_id`` and the ``X-Claude-Code-Session-Id`` header,
streaming, no temperature: the server runs greedy here); the main conversation's prompt
is ~1,500 tokens so a miss is plain to see.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import anthropic
import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query

MAIN_SYSTEM = ("You are Claude Code, an interactive CLI tool that helps users with software engineering tasks. "
               + "Keep answers short, use the tools when a file must be read, never guess file contents. " * 40)
TOOLS = [{"name": "Bash", "description": "Run a shell command and return its output.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
         {"name": "Read", "description": "Read a file from the local filesystem.",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]}}]
TITLE_SYSTEM = "Generate a concise, sentence-case title (3-7 words) that captures the main topic of the conversation."
SUBAGENT_SYSTEM = "You are an agent for Claude Code. Given the user's message, use the tools to complete the task."


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir) -> Any:  # type: ignore[no-untyped-def]
    # Claude Code sends no temperature; greedy keeps every reply, and so every prompt, reproducible.
    running = start_server(tmp_path_factory.mktemp("conversations"), smollm2_dir,
                           {"SEMANTIC_DEFAULT_TEMPERATURE": "0"})
    yield running
    stop_server(running)


def system_blocks(text: str, session: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{session[:3]}; "
                                     "cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def send(server: ServerProcess, session: str, system: str, messages: list[dict[str, Any]],
         tools: list[dict[str, Any]] | None = None, max_tokens: int = 12) -> anthropic.types.Message:
    """One streamed request as Claude Code sends it; returns the final message."""
    client = anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})
    with client.messages.stream(model="claude-sonnet-5", max_tokens=max_tokens, system=system_blocks(system, session),
                                messages=messages, tools=tools or [], metadata={"user_id": user_id},
                                extra_headers={"X-Claude-Code-Session-Id": session}) as stream:
        return stream.get_final_message()


def read_share(message: anthropic.types.Message) -> float:
    usage = message.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    return usage.cache_read_input_tokens / total


def as_history(message: anthropic.types.Message) -> dict[str, Any]:
    return {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}


MAIN_1 = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>Today is 2026-11-22.</system-reminder>"},
                                       {"type": "text", "text": "What does this repository do?"}]}]


@pytest.mark.parametrize("title_last", [True, False], ids=["title-finishes-last", "main-finishes-last"])
def test_a_title_request_racing_main_turn_1_does_not_evict_it(greedy_server: ServerProcess, title_last: bool) -> None:
    session = str(uuid.uuid4())
    results: dict[str, anthropic.types.Message] = {}

    def main() -> None:
        results["main"] = send(greedy_server, session, MAIN_SYSTEM, MAIN_1, TOOLS)

    def title() -> None:
        results["title"] = send(greedy_server, session, TITLE_SYSTEM,
                                [{"role": "user", "content": "What does this repository do?"}], max_tokens=8)

    first, second = (main, title) if title_last else (title, main)
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    time.sleep(0.3)  # both in flight; the engine serves them in arrival order
    threads[1].start()
    for thread in threads:
        thread.join()
    turn_2 = [*MAIN_1, as_history(results["main"]), {"role": "user", "content": "And how do I run its tests?"}]
    main_2 = send(greedy_server, session, MAIN_SYSTEM, turn_2, TOOLS)
    assert read_share(main_2) >= 0.95, main_2.usage
    rows = query(greedy_server.db_path, "SELECT conversation_id, position, role FROM messages WHERE agent_id = ? "
                 "ORDER BY conversation_id, position", session)
    by_conversation: dict[str, list[str]] = {}
    for conversation, _, role in rows:
        by_conversation.setdefault(conversation, []).append(role)
    # Two conversations, each complete and in order: nothing of one mixed into the other.
    assert sorted(by_conversation.values(), key=len) == [["user", "assistant"],
                                                         ["user", "assistant", "user", "assistant"]]
    outcomes = query(greedy_server.db_path, "SELECT reuse_reason FROM requests WHERE agent_id = ? "
                     "ORDER BY created_at", session)
    assert outcomes[-1] == ("extend",)


def test_two_conversations_interleaved_for_six_turns_each(greedy_server: ServerProcess) -> None:
    """A main conversation and a subagent's, alternating under one session id: from each one's
    second turn on, at least 95% of every prompt comes from cache."""
    session = str(uuid.uuid4())
    histories = {"main": [], "sub": []}  # type: dict[str, list[dict[str, Any]]]
    systems = {"main": (MAIN_SYSTEM, TOOLS), "sub": (SUBAGENT_SYSTEM + " " + MAIN_SYSTEM[:2000], TOOLS[1:])}
    for turn in range(6):
        for name in ("main", "sub"):
            system, tools = systems[name]
            histories[name].append({"role": "user", "content": f"Step {turn + 1} for the {name} task: list one file."})
            reply = send(greedy_server, session, system, histories[name], tools)
            histories[name].append(as_history(reply))
            if turn:
                assert read_share(reply) >= 0.95, (name, turn, reply.usage)
    rows = query(greedy_server.db_path, "SELECT count(DISTINCT conversation_id), count(*) FROM messages "
                 "WHERE agent_id = ?", session)
    assert rows == [(2, 24)]
    turns = query(greedy_server.db_path, "SELECT turns FROM conversation_turns WHERE agent_id = ?", session)
    assert sorted(turns) == [(6,), (6,)]


def test_an_edit_in_the_middle_of_message_3_is_diagnosed(greedy_server: ServerProcess) -> None:
    """Message 3 (``messages.2``) is edited mid-sentence: the request row says where (the part,
    the character offset, the stored and the new text there), and so do the view, the metric
    and the log."""
    session = str(uuid.uuid4())
    history = [{"role": "user", "content": "Remember these words."}]
    history.append(as_history(send(greedy_server, session, MAIN_SYSTEM, history)))
    history.append({"role": "user", "content": "Now: alpha beta GAMMA delta epsilon, the words to keep."})
    history.append(as_history(send(greedy_server, session, MAIN_SYSTEM, history)))
    edited = [*history[:3], {"role": "assistant", "content": history[3]["content"]},
              {"role": "user", "content": "Thanks."}]
    edited[2] = {"role": "user", "content": "Now: alpha beta OMEGA delta epsilon, the words to keep."}
    response = send(greedy_server, session, MAIN_SYSTEM, edited)
    assert response.usage.cache_read_input_tokens > 0  # everything up to the edit is still reused
    (row,) = query(greedy_server.db_path, "SELECT reuse_reason, diverge_part, diverge_offset, diverge_stored, "
                   "diverge_new, n_reused_chars FROM requests WHERE agent_id = ? ORDER BY created_at DESC LIMIT 1",
                   session)
    reason, part, offset, stored, new, n_chars = row
    # The edited request is a new conversation whose cache starts from the first one's.
    assert (reason, part) == ("sibling", "messages.2")
    assert stored[30:].startswith("GAMMA delta") and new[30:].startswith("OMEGA delta")
    assert stored[:30] == new[:30]  # the context before the edit, the same in both
    assert 0 < n_chars <= offset
    misses = query(greedy_server.db_path, "SELECT diverge_part FROM cache_misses WHERE agent_id = ?", session)
    assert ("messages.2",) in misses
    metrics = httpx.get(f"{greedy_server.url}/metrics").text
    assert 'semantic_cache_reuse_reasons_total{reason="sibling"}' in metrics
    assert f"stored text parts from the prompt at char {offset} in messages.2" in greedy_server.log()
