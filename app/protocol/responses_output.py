"""OpenAI Responses API output: the response object, its items, the SSE events and errors. Pure.

A reply becomes output items in the order the model wrote them: a ``reasoning`` item
for a leading ``<think>`` block (when ``reasoning`` was requested), ``message`` items
for text, and one ``function_call`` or ``custom_tool_call`` per tool call, named and
namespaced as the client defined the tool (``app.protocol.responses``). When the reply
calls a tool, each text item is stripped of trailing whitespace and whitespace-only
text is left out. Streaming sends exactly the items the whole reply gives: the same
ids, texts and order.

Event order (what Codex and the SDK's stream helper need): ``response.created`` and
``response.in_progress`` at once; per item ``response.output_item.added``, its deltas
(``response.output_text.delta`` inside ``content_part.added`` / ``.done``,
``response.function_call_arguments.delta``, ``response.custom_tool_call_input.delta``,
``response.reasoning_text.delta``) and ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete`` when the client's
``max_output_tokens`` cut the reply, or ``response.failed``). A long prefill repeats
``response.in_progress`` as a keep-alive: an SSE comment would not reset a client's
idle timer (Codex gives up after 300 s without an event).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from app.errors import ContextTooLong, InvalidRequest, NotFound, Overloaded, SemanticError
from app.protocol import openai, tools
from app.protocol.reply import Reply, ReplyParser, Thinking, parse_reply
from app.protocol.responses import ResponsesDetails
from app.protocol.turn import ParsedTurn
from app.types import Finished, GenerationEvent, Heartbeat, Started, TextDelta, TokenLogprob


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _id(response_id: str, *parts: object) -> str:
    return hashlib.sha256(":".join(map(str, (response_id, *parts))).encode()).hexdigest()[:32]


def _details(parsed: ParsedTurn) -> ResponsesDetails:
    assert isinstance(parsed.details, ResponsesDetails)
    return parsed.details


def _message(response_id: str, index: int, text: str, status: str = "completed",
             logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{_id(response_id, index)}", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status == "completed" else []}


def _text_part(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """An ``output_text`` part; ``logprobs``: its tokens' (a request that asks gets a plain text
    reply, one message: every output token is its text's)."""
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [openai.logprob_entry(e) for e in logprobs]}


def _reasoning(response_id: str, index: int, text: str | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "id": f"rs_{_id(response_id, index)}", "summary": []}
    if text is not None:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item


def _call(response_id: str, index: int, parsed: ParsedTurn, call: tools.ToolCall, done: bool) -> dict[str, Any]:
    """A tool call as the client defined the tool: a custom tool's call carries its one string."""
    offered = _details(parsed).tools.get(call.name)
    name, namespace = (offered.name, offered.namespace) if offered else (call.name, None)
    ids = {"id": f"{'ctc' if offered and offered.kind == 'custom' else 'fc'}_{_id(response_id, index)}",
           "status": "completed" if done else "in_progress", "call_id": f"call_{_id(response_id, index, 'call')[:24]}"}
    if offered is not None and offered.kind == "custom":
        value = call.arguments.get("input")
        text = value if isinstance(value, str) else json.dumps(call.arguments, ensure_ascii=False)
        item = {"type": "custom_tool_call", **ids, "name": name, "input": text if done else ""}
    else:
        item = {"type": "function_call", **ids, "name": name,
                "arguments": json.dumps(call.arguments, ensure_ascii=False) if done else ""}
    if namespace:
        item["namespace"] = namespace
    return item


def reply_items(response_id: str, parsed: ParsedTurn, text: str,
                logprobs: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
    """The output items of a whole reply; ``logprobs`` (asked for: a plain text reply) go with
    its message's text."""
    segments: list[Any] = []
    parts: list[Any] = parse_reply(parsed, text)
    for part in parts:
        last: Any = segments[-1] if segments else None
        if isinstance(part, tools.ToolCall) or type(last) is not type(part):
            segments.append(part)
        elif isinstance(part, Thinking):
            segments[-1] = Thinking(last.text + part.text)
        else:
            segments[-1] = last + part
    called = any(isinstance(s, tools.ToolCall) for s in segments)
    items: list[dict[str, Any]] = []
    for segment in segments:
        if isinstance(segment, tools.ToolCall):
            items.append(_call(response_id, len(items), parsed, segment, done=True))
        elif isinstance(segment, Thinking):
            items.append(_reasoning(response_id, len(items), segment.text))
        elif not called or segment.rstrip():
            items.append(_message(response_id, len(items), segment.rstrip() if called else segment,
                                  logprobs=logprobs if not called else ()))
            logprobs = ()
    if not any(item["type"] != "reasoning" for item in items):
        items.append(_message(response_id, len(items), "", logprobs=logprobs))
    return items


def history_items(response_id: str, parsed: ParsedTurn, text: str) -> list[dict[str, Any]]:
    """The reply's items as history keeps them (and the client resends them)."""
    return list(kept_items(reply_items(response_id, parsed, text)))


def kept_items(output: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Output items as history keeps them: reasoning left out."""
    return tuple(item for item in output if item["type"] != "reasoning")


def history_entry(item: dict[str, Any]) -> tuple[str, Any]:
    """(role, content) of an item in history: the item as received, under its speaker's role."""
    kind = item.get("type", "message")
    role = item.get("role") if kind == "message" else "tool" if kind.endswith("_output") else "assistant"
    return str(role), item


def usage(finished: Finished) -> dict[str, Any]:
    return {"input_tokens": finished.n_prompt_tokens,
            "input_tokens_details": {"cached_tokens": finished.n_cached_tokens,
                                     "cache_write_tokens": finished.n_cache_written},
            "output_tokens": finished.n_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finished.n_prompt_tokens + finished.n_output_tokens}


def _status(parsed: ParsedTurn, finished: Finished) -> str:
    if finished.stop_reason == "cancelled":
        return "cancelled"
    # A reply cut by the server's default bound is complete as far as the client asked: Codex
    # sets no max_output_tokens and treats response.incomplete as a failed turn.
    return "incomplete" if finished.stop_reason == "max_tokens" and _details(parsed).bounded else "completed"


def response_object(response_id: str, parsed: ParsedTurn, status: str, output: list[dict[str, Any]],
                    finished: Finished | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
    details = _details(parsed)
    created_at = details.echo["created_at"]
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "completed_at": created_at + round(finished.total_s) if finished and status == "completed" else None,
            "error": error, "model": parsed.model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "previous_response_id": details.previous_response_id, "background": False, "service_tier": "default",
            "usage": usage(finished) if finished else None,
            **{k: v for k, v in details.echo.items() if k != "created_at"}}


def render_response(response_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> dict[str, Any]:
    """The response object of a finished reply (the non-streaming body, and what is stored)."""
    logprobs = finished.logprobs if parsed.sampling.logprobs is not None else ()
    return response_object(response_id, parsed, _status(parsed, finished),
                           reply_items(response_id, parsed, text, logprobs), finished)


def whole_reply(response_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> Reply:
    """The non-streaming reply from one parse of ``text``: the response object, what history
    keeps, and the object to keep (``store``, true unless the request said false)."""
    body = render_response(response_id, parsed, text, finished)
    return Reply(kept_items(body["output"]), body=body, stored=body if _details(parsed).store else None)


def error_code(exc: SemanticError) -> str | None:
    """The OpenAI error code of an exception (None: only its type says what went wrong)."""
    if isinstance(exc, ContextTooLong):
        return "context_length_exceeded"
    if isinstance(exc, Overloaded):
        return "rate_limit_exceeded"
    if isinstance(exc, NotFound):
        return "not_found"
    return None


def render_error(status: int, message: str, exc: SemanticError | None = None) -> dict[str, Any]:
    """An HTTP error body: OpenAI's shape, ``param`` naming the field of a bad request."""
    body = openai.render_error(status, message)
    body["error"]["param"] = exc.field if isinstance(exc, InvalidRequest) else None
    body["error"]["code"] = (error_code(exc) if exc is not None else None) or body["error"]["code"]
    return body


class _Stream:
    """Event bookkeeping for one streamed response: sequence numbers and the open item."""

    def __init__(self, response_id: str, parsed: ParsedTurn) -> None:
        self.response_id, self.parsed = response_id, parsed
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # every item opened, finished ones complete
        self.open: dict[str, Any] | None = None  # the message or reasoning item receiving deltas
        self.open_text = ""
        self.held = ""  # trailing whitespace of text, sent once more text follows
        self.called = False
        self.logprobs: list[TokenLogprob] = []  # (asked for) the tokens not sent with a delta yet
        self.open_logprobs: list[TokenLogprob] = []  # those of the open message's text

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def lifecycle(self, kind: str, status: str, finished: Finished | None = None,
                  error: dict[str, str] | None = None) -> dict[str, Any]:
        output = self.output if kind != "response.in_progress" and kind != "response.created" else []
        return self.event(kind, response=response_object(self.response_id, self.parsed, status, output, finished,
                                                         error))

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _open(self, item: dict[str, Any], part: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self.close()
        self.output.append(item)
        self.open, self.open_text, self.open_logprobs = item, "", []
        yield self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        yield self.event("response.content_part.added", **self._where(), part=part)

    def close(self) -> Iterator[dict[str, Any]]:
        if self.open is None:
            return
        where, index, text = self._where(), len(self.output) - 1, self.open_text
        if self.open["type"] == "reasoning":
            item = _reasoning(self.response_id, index, text)
            part = item["content"][0]
            yield self.event("response.reasoning_text.done", **where, text=text)
        else:
            item = _message(self.response_id, index, text, logprobs=self.open_logprobs)
            part = _text_part(text, self.open_logprobs)
            yield self.event("response.output_text.done", **where, text=text, logprobs=part["logprobs"])
        yield self.event("response.content_part.done", **where, part=part)
        self.output[index], self.open = item, None
        yield self.event("response.output_item.done", output_index=index, item=item)

    def text(self, text: str) -> Iterator[dict[str, Any]]:
        whole = self.held + text
        body = whole.rstrip()
        self.held = whole[len(body):]
        if not body:
            return
        if self.open is None or self.open["type"] != "message":
            yield from self._open(_message(self.response_id, len(self.output), "", "in_progress"), _text_part(""))
        self.open_text += body
        yield self.event("response.output_text.delta", **self._where(), delta=body, logprobs=self._sent_logprobs())

    def _sent_logprobs(self) -> list[dict[str, Any]]:
        """The tokens generated up to this delta and not sent yet: the delta's own (a token's
        trailing whitespace held back goes with the delta that sends it)."""
        sent, self.logprobs = self.logprobs, []
        self.open_logprobs += sent
        return [openai.logprob_entry(e) for e in sent]

    def thinking(self, text: str) -> Iterator[dict[str, Any]]:
        if self.open is None or self.open["type"] != "reasoning":
            yield from self._open(_reasoning(self.response_id, len(self.output), None),
                                  {"type": "reasoning_text", "text": ""})
        self.open_text += text
        yield self.event("response.reasoning_text.delta", **self._where(), delta=text)

    def call(self, call: tools.ToolCall) -> Iterator[dict[str, Any]]:
        self.held, self.called = "", True
        yield from self.close()
        index = len(self.output)
        done = _call(self.response_id, index, self.parsed, call, done=True)
        self.output.append(done)
        yield self.event("response.output_item.added", output_index=index,
                         item=_call(self.response_id, index, self.parsed, call, done=False))
        where = {"item_id": done["id"], "output_index": index}
        if done["type"] == "custom_tool_call":
            yield self.event("response.custom_tool_call_input.delta", **where, delta=done["input"])
            yield self.event("response.custom_tool_call_input.done", **where, input=done["input"])
        else:
            yield self.event("response.function_call_arguments.delta", **where, delta=done["arguments"])
            yield self.event("response.function_call_arguments.done", **where, arguments=done["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=done)

    def parts(self, found: list[Any]) -> Iterator[dict[str, Any]]:
        for part in found:
            if isinstance(part, tools.ToolCall):
                yield from self.call(part)
            elif isinstance(part, Thinking):
                yield from self.thinking(part.text)
            else:
                yield from self.text(part)

    def finish(self) -> Iterator[dict[str, Any]]:
        """What a whole reply's items have and the stream has not sent yet."""
        if self.held and not self.called:
            held, self.held = self.held, ""
            if self.open is None or self.open["type"] != "message":
                yield from self._open(_message(self.response_id, len(self.output), "", "in_progress"),
                                      _text_part(""))
            self.open_text += held
            yield self.event("response.output_text.delta", **self._where(), delta=held, logprobs=self._sent_logprobs())
        if not any(item["type"] != "reasoning" for item in self.output):
            yield from self._open(_message(self.response_id, len(self.output), "", "in_progress"), _text_part(""))
        if self.open is not None and self.open["type"] == "message":  # tokens that wrote no text: the done event's
            self.open_logprobs += self.logprobs
        self.logprobs = []
        yield from self.close()


def render_events(response_id: str, parsed: ParsedTurn,
                  events: Iterator[GenerationEvent]) -> Generator[dict[str, Any] | Reply, None, None]:
    """Engine events -> Responses API stream events (each a dict with its ``type``); once
    generation finished, the ``Reply`` the stream sent (its last event's response object to
    keep), before its closing events.

    An error from ``events`` ends the stream with ``response.failed`` and is raised again
    (the caller records it)."""
    stream = _Stream(response_id, parsed)
    parser = ReplyParser.for_turn(parsed)
    yield stream.lifecycle("response.created", "in_progress")
    yield stream.lifecycle("response.in_progress", "in_progress")
    try:
        for event in events:
            if isinstance(event, Heartbeat):
                yield stream.lifecycle("response.in_progress", "in_progress")
            elif isinstance(event, TextDelta):
                stream.logprobs += event.logprobs if parsed.sampling.logprobs is not None else ()
                yield from stream.parts(parser.feed(event.text))
            elif isinstance(event, Finished):
                closing = [*stream.parts(parser.finish()), *stream.finish()]
                status = _status(parsed, event)
                last = stream.lifecycle(f"response.{'incomplete' if status == 'incomplete' else 'completed'}",
                                        status, event)
                yield Reply(kept_items(stream.output), stored=last["response"] if _details(parsed).store else None)
                yield from closing
                yield last
            else:
                assert isinstance(event, Started)
    except SemanticError as exc:
        error = {"code": error_code(exc) or "server_error", "message": str(exc)}
        yield stream.lifecycle("response.failed", "failed", error=error)
        raise


def render_warmup(response_id: str, parsed: ParsedTurn) -> list[dict[str, Any]]:
    """The events of a warm-up (``generate: false`` over the WebSocket): the response created and
    completed with no output; its id continues from the request's input."""
    stream = _Stream(response_id, parsed)
    return [stream.lifecycle("response.created", "in_progress"), stream.lifecycle("response.completed", "completed")]
