"""Keep-alives while a stream waits (a long prefill): in each protocol's own form, and
never before the Anthropic stream's message_start."""

from __future__ import annotations

from app.protocol import anthropic, openai
from app.types import Finished, Heartbeat, RequestOptions, Started, TextDelta

BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
EVENTS = [Heartbeat(), Started(5, 0, 5), Heartbeat(), Heartbeat(), TextDelta("Hello"),
          Finished("end_turn", None, 5, 0, 5, 1, 0.1, 0.2)]


def test_anthropic_pings_only_after_message_start() -> None:
    names = [name for name, _ in anthropic.render_events("msg_1", anthropic.parse_request(BODY, RequestOptions()),
                                                         iter(EVENTS))]
    assert names[0] == "message_start"
    assert names.count("ping") == 3  # the one after message_start, then one per heartbeat
    assert names[-1] == "message_stop"


def test_openai_sends_an_sse_comment() -> None:
    chunks = list(openai.render_chunks("c1", openai.parse_request(BODY, RequestOptions()), iter(EVENTS)))
    assert chunks.count(openai.KEEP_ALIVE) == 3 and chunks[-1] == "[DONE]"
    assert openai.KEEP_ALIVE.startswith(":")  # a comment line: SSE clients skip it
