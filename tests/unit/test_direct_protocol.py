"""The direct agent API's requests: stored history replayed as an Anthropic Messages body."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import InvalidRequest
from app.protocol import anthropic, direct
from app.types import RequestOptions

CALL = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}
STORED: list[tuple[str, Any]] = [
    ("system", "Be brief."),  # the agent's system prompt applies instead
    ("user", "List files."),
    ("assistant", [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "Sure."}, CALL]),
    ("user", [RESULT]),
    ("assistant", [{"type": "thinking", "thinking": "only thought", "signature": "s"}]),  # nothing left to replay
    ("assistant", "One file."),
]


def test_stored_history_is_replayed_in_the_messages_shape_before_the_new_messages() -> None:
    history = direct.replay(STORED)
    assert history == [{"role": "user", "content": "List files."},
                       {"role": "assistant", "content": [{"type": "text", "text": "Sure."}, CALL]},
                       {"role": "user", "content": [RESULT]},
                       {"role": "assistant", "content": "One file."}]
    new = {"messages": [{"role": "user", "content": "Thanks."}], "temperature": 0.0, "new_conversation": False,
           "unknown": 1}
    body = direct.request_body(new, history, "Be brief.", 64)
    assert body == {"temperature": 0.0, "model": "default", "max_tokens": 64, "system": "Be brief.",
                    "messages": [*history, *new["messages"]]}
    assert "system" not in direct.request_body(new, [], None, 64)
    parsed = anthropic.parse_request(body, RequestOptions())  # a valid Messages request
    assert [m.role for m in parsed.messages] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_a_generate_request_needs_new_messages_and_says_whether_it_starts_a_conversation() -> None:
    assert direct.starts_conversation({"messages": [{"role": "user", "content": "hi"}], "new_conversation": True})
    assert not direct.starts_conversation({"messages": [{"role": "user", "content": "hi"}]})
    for bad, field in (({}, "messages"), ({"messages": []}, "messages"),
                       ({"messages": [{"role": "user", "content": "hi"}], "new_conversation": "yes"},
                        "new_conversation")):
        with pytest.raises(InvalidRequest) as info:
            direct.starts_conversation(bad)
        assert info.value.field == field
    direct.refuse_foreign("a1", {"direct"})
    with pytest.raises(InvalidRequest, match="through the openai API"):
        direct.refuse_foreign("a1", {"direct", "openai", "responses"})
