"""Keep-alives while a stream waits (a long prefill): in each protocol's own form, never
before the Anthropic stream's message_start, and carrying the prefill's progress (issue 40
item 6: before, a 4,249-token prompt streamed nothing but ``: keep-alive`` for 67 s)."""

from __future__ import annotations

import threading
import time

from app.api.chat import _stream as openai_stream
from app.api.messages import _stream as anthropic_stream
from app.engine.channel import Job
from app.protocol import anthropic, openai
from app.protocol.reply import Reply
from app.types import (Finished, GenerationRequest, Heartbeat, Prompt, RequestOptions, SamplingParams, Started,
                       TextDelta)

BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
EVENTS = [Heartbeat(), Started(4249, 0, 4249), Heartbeat(1024, 4249), Heartbeat(), TextDelta("Hello"),
          Finished("end_turn", None, 5, 0, 5, 1, 0.1, 0.2)]
PROGRESS = b": prefill 1024/4249 prompt tokens\n\n"


def test_anthropic_pings_only_after_message_start_and_says_the_progress_beside_them() -> None:
    names = [e[0] for e in anthropic.render_events("msg_1", anthropic.parse_request(BODY, RequestOptions()),
                                                   iter(EVENTS)) if not isinstance(e, Reply)]
    assert names[0] == "message_start"
    assert names.count("ping") == 3  # the one after message_start, then one per heartbeat
    assert names[-1] == "message_stop"
    frames = list(anthropic_stream("msg_1", anthropic.parse_request(BODY, RequestOptions()), iter(EVENTS)))
    assert frames.count(PROGRESS) == 1
    at = frames.index(PROGRESS)
    assert frames[at + 1].startswith(b"event: ping") and frames[0].startswith(b"event: message_start")


def test_openai_sends_an_sse_comment_with_the_progress() -> None:
    frames = list(openai_stream("c1", openai.parse_request(BODY, RequestOptions()), iter(EVENTS)))
    assert frames.count(b": keep-alive\n\n") == 2 and frames.count(PROGRESS) == 1  # comments: SSE clients skip them
    assert frames[-1] == b"data: [DONE]\n\n"


def test_a_job_streams_its_prefill_progress_each_time_it_moves() -> None:
    """The engine sets ``job.progress`` after each prefill chunk; a stream waiting with a
    10 s heartbeat gets a heartbeat carrying it once it moved (``PROGRESS_S`` apart)."""
    request = GenerationRequest("req_1", Prompt("hi", (1,), (2,)), SamplingParams(), "a", "c")
    job = Job(request, alive=lambda: True)
    finished = Finished("end_turn", None, 5, 0, 5, 1, 0.1, 0.2)

    def engine() -> None:
        time.sleep(0.2)
        job.progress = (1024, 4249)
        time.sleep(1.6)
        job.progress = (2048, 4249)
        time.sleep(1.6)
        job.put(finished)

    threading.Thread(target=engine, daemon=True).start()
    events = list(job.events(heartbeat_s=10.0))
    assert events == [Heartbeat(1024, 4249), Heartbeat(2048, 4249), finished]
