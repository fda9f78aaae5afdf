"""Side requests under one session are their own conversations (issue 23): a Codex compaction or
review between two main turns, a Claude Code subagent between two main turns, each resending the
main conversation, leaves the main thread's next turn continuing its own conversation, >= 95% cached,
and its history as it was.

Without the thread headers each of these side requests would continue the main conversation by
content (they resend it), and the main thread's next turn would find its conversation moved on.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query

INSTRUCTIONS = ("You are a coding agent running in a terminal. Keep answers short, run commands when a file must be "
                "read, never guess file contents. " * 40)
TOOLS = [{"type": "function", "name": "exec_command", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    # Neither client sends a temperature; greedy keeps every reply, and so every prompt, reproducible.
    running = start_server(tmp_path_factory.mktemp("threads"), smollm2_dir, {"SEMANTIC_DEFAULT_TEMPERATURE": "0"})
    yield running
    stop_server(running)


def codex_turn(server: ServerProcess, session: str, items: list[dict[str, Any]], **headers: str) -> Any:
    """One request as Codex sends it (streamed, store false, its headers); returns the final response."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)
    stream = client.responses.create(
        model="smollm2-135m-instruct", input=items, tools=TOOLS, tool_choice="auto", stream=True, store=False,
        parallel_tool_calls=True, reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"],
        prompt_cache_key=session, max_output_tokens=12,
        extra_headers={"session-id": session, "thread-id": session, **headers})
    final = [event for event in stream][-1]
    assert final.type in ("response.completed", "response.incomplete"), final
    return final.response


def cached_share(response: Any) -> float:
    return response.usage.input_tokens_details.cached_tokens / response.usage.input_tokens


def main_rows(server: ServerProcess, agent: str) -> list[tuple[Any, ...]]:
    return query(server.db_path, "SELECT q.conversation_id, q.reuse_reason, c.thread FROM requests q "
                 "JOIN conversations c ON c.id = q.conversation_id WHERE q.agent_id = ? ORDER BY q.created_at", agent)


def test_codex_compaction_and_review_between_main_turns(greedy_server: ServerProcess) -> None:
    session = str(uuid.uuid4())
    turn_1 = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What does this do?"}]}]
    main_1 = codex_turn(greedy_server, session, turn_1)
    history = [*turn_1, *(item.model_dump(exclude_none=True) for item in main_1.output)]
    summarize = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Summarize."}]}
    codex_turn(greedy_server, session, [*history, summarize], **{"x-openai-subagent": "compact"})
    reviewer = str(uuid.uuid4())
    codex_turn(greedy_server, session, [*history, {"role": "user", "content": "Review the changes."}],
               **{"thread-id": reviewer, "x-codex-parent-thread-id": session, "x-openai-subagent": "review"})
    main_2 = codex_turn(greedy_server, session, [*history, {"role": "user", "content": "And its tests?"}])
    assert cached_share(main_2) >= 0.95, main_2.usage
    rows = main_rows(greedy_server, session)
    assert [thread for _, _, thread in rows] == [session, f"{session}/compact", f"{reviewer}/review", session]
    # The side requests start from the main conversation's cache; the main thread's next turn continues its own
    # conversation (from its own cache, or from a side request's when that matches a few tokens further).
    assert [reason for _, reason, _ in rows][1:3] == ["sibling", "sibling"]
    assert rows[0][0] == rows[3][0] and len({row[0] for row in rows}) == 3
    roles = query(greedy_server.db_path, "SELECT role FROM messages WHERE conversation_id = ? ORDER BY position",
                  rows[0][0])
    assert [r for (r,) in roles] == ["developer", "user", "assistant", "user", "assistant"]


def test_a_claude_code_subagent_between_main_turns(greedy_server: ServerProcess) -> None:
    session = str(uuid.uuid4())
    client = anthropic.Anthropic(base_url=greedy_server.url, api_key="dummy-key", max_retries=0)
    tools = [{"name": "Bash", "description": "Run a shell command.",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]

    def send(messages: list[dict[str, Any]], **headers: str) -> anthropic.types.Message:
        user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})
        with client.messages.stream(model="claude-sonnet-5", max_tokens=12, system=INSTRUCTIONS, tools=tools,
                                    messages=messages, metadata={"user_id": user_id},
                                    extra_headers={"X-Claude-Code-Session-Id": session, **headers}) as stream:
            return stream.get_final_message()

    history = [{"role": "user", "content": "What does this repository do?"}]
    main_1 = send(history)
    history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in main_1.content]})
    subagent = "a" + uuid.uuid4().hex[:16]
    send([*history, {"role": "user", "content": "Survey the files."}],
         **{"x-claude-code-agent-id": subagent, "x-claude-code-parent-agent-id": session})
    main_2 = send([*history, {"role": "user", "content": "And how do I run its tests?"}])
    usage = main_2.usage
    assert usage.cache_read_input_tokens / (usage.input_tokens + usage.cache_read_input_tokens
                                            + usage.cache_creation_input_tokens) >= 0.95, usage
    rows = main_rows(greedy_server, session)
    assert [(reason, thread) for _, reason, thread in rows][1:] == [("sibling", subagent), (rows[2][1], None)]
    assert rows[0][0] == rows[2][0] != rows[1][0] and rows[0][2] is None
    roles = query(greedy_server.db_path, "SELECT role FROM messages WHERE conversation_id = ? ORDER BY position",
                  rows[0][0])
    assert [r for (r,) in roles] == ["user", "assistant", "user", "assistant"]
