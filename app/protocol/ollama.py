"""The Ollama API's generation endpoints (``/api/chat``, ``/api/generate``): parse requests,
render replies, NDJSON lines and errors. Pure.

An Ollama chat request is an OpenAI chat request in other clothes (the same roles, tools in
OpenAI's shape, tool calls with their arguments as an object instead of JSON text), so it is
parsed by rewriting it into one and handing that to ``app.protocol.openai``: the template,
tools and history behave exactly as they do there, and history keeps the OpenAI shape. An
``/api/generate`` request is a chat of its ``system`` and ``prompt``.

``options`` map to sampling: ``temperature``, ``top_p``, ``top_k``, ``num_predict`` (the
reply's token limit; -1 and -2: up to the context), ``stop``, ``seed`` (reproducible
sampling, as the OpenAI API's ``seed``). ``format`` ("json", or a JSON schema) holds the
reply to JSON, as the OpenAI API's ``response_format`` does (``app.protocol.structured``).
Options that only tune the runtime (``num_ctx``, ``num_thread``, ``num_gpu``, ...) are
accepted and change nothing (``HARMLESS_OPTIONS``); penalties and other samplers are
accepted at their neutral value only (``NEUTRAL_OPTIONS``); anything else is a 400 naming
the option. Request fields that change the answer and are not supported (``think``,
``images``, ``raw``, ``context``, ``suffix``, ``template``) are a 400 naming the field;
``logprobs`` / ``top_logprobs`` return each output token's entry (``logprobs``, on each
streamed line too), in the shape Ollama and OpenAI share; ``keep_alive`` is accepted and
ignored (the model stays loaded). Extension: ``session_id`` names the agent, as in the
OpenAI API (also the ``X-Session-ID`` header).

Durations are nanoseconds: ``load_duration`` is the time the conversation's cache took to
come back into memory, ``prompt_eval_count`` the prompt tokens computed this turn (those
not served from the cache, as Ollama counts them), ``prompt_eval_duration`` their prefill.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest
from app.protocol import openai, structured
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.protocol.validation import ModelName, validate
from app.types import Finished, GenerationEvent, RequestOptions, TokenLogprob

# Options that tune how the model runs, not what it answers.
HARMLESS_OPTIONS = frozenset({"num_ctx", "num_thread", "num_gpu", "main_gpu", "num_batch", "num_keep", "use_mmap",
                              "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only"})
# Options our sampling does not have, at the value that makes them change nothing.
NEUTRAL_OPTIONS: dict[str, float] = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                     "min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0,
                                     "penalize_newline": False, "repeat_last_n": 64}
SAMPLING_OPTIONS = frozenset({"temperature", "top_p", "top_k", "num_predict", "stop", "seed"})

DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class OllamaToolFunction(_Body):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Body):
    function: OllamaToolFunction


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool result: the tool that gave it
    thinking: str | None = None  # an earlier reply's reasoning: not part of the prompt


class _Generation(_Body):
    model: ModelName
    stream: bool = True
    options: dict[str, Any] | None = Field(default=None, description=(
        "temperature, top_p, top_k, num_predict, stop, seed; runtime options such as num_ctx and num_thread "
        "are accepted and change nothing; others are refused by name"))
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    think: bool | str | None = None  # refused unless false
    logprobs: bool | None = None  # each output token's log-probability (as the OpenAI chat API's)
    top_logprobs: int | None = None  # with logprobs: how many alternatives (0 to 20)
    keep_alive: str | int | float | None = None  # accepted, ignored
    session_id: str | None = None


class OllamaChatBody(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateBody(_Generation):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None  # refused: fill-in-the-middle
    template: str | None = None  # refused: the model's own chat template is used
    raw: bool = False  # refused when true
    context: list[int] | None = None  # refused: continue with /api/chat or the whole prompt
    images: list[str] | None = None  # refused: the models are text-only


class OllamaShowBody(_Body):
    model: ModelName | None = None
    name: ModelName | None = None  # older clients' spelling
    verbose: bool = False


def _refuse(where: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {why}", where)


def _common_refusals(body: _Generation) -> None:
    if body.think not in (None, False):
        raise _refuse("think", "thinking is not supported by this server")


def _response_format(body: _Generation) -> dict[str, Any] | None:
    """``format`` as the OpenAI chat API's ``response_format`` (None: plain text).

    Raises:
        InvalidRequest: a format that is neither "json" nor a schema llguidance can hold.
    """
    if body.format in (None, ""):
        return None
    if body.format == "json":
        return {"type": "json_object"}
    if not isinstance(body.format, dict):
        raise _refuse("format", "must be \"json\" or a JSON schema")
    structured.response_format(body.format, "format")  # a schema it cannot hold: a 400 naming format
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}


def _sampling(options: dict[str, Any] | None, limits: RequestOptions) -> dict[str, Any]:
    """``options`` as OpenAI chat fields (and ``top_k``, which OpenAI lacks).

    Raises:
        InvalidRequest: an option that would change the answer and is not supported.
    """
    options = options or {}
    for name, value in options.items():
        if name in SAMPLING_OPTIONS or name in HARMLESS_OPTIONS:
            continue
        if name in NEUTRAL_OPTIONS and value == NEUTRAL_OPTIONS[name]:
            continue
        if name in NEUTRAL_OPTIONS:
            raise _refuse(f"options.{name}", f"not supported (only {NEUTRAL_OPTIONS[name]!r}, which changes nothing)")
        raise _refuse(f"options.{name}", "not a supported option")
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "stop"):
        if options.get(name) is not None:
            fields[name] = options[name]
    top_k = options.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        raise _refuse("options.top_k", "must be an integer >= 0")
    predict = options.get("num_predict")
    if predict is not None:
        if not isinstance(predict, int) or isinstance(predict, bool) or predict == 0 or predict < -2:
            raise _refuse("options.num_predict", "must be a positive integer, or -1 / -2 (up to the context)")
        fields["max_tokens"] = limits.max_output_tokens if predict < 0 else predict
    seed = options.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise _refuse("options.seed", "must be an integer")
        fields["seed"] = seed
    return {**fields, "top_k": top_k or 0}


def _openai_message(message: OllamaMessage, where: str) -> dict[str, Any]:
    if message.images:
        raise _refuse(f"{where}.images", "image input is not supported: the served models are text-only")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [{"id": f"call_{j}", "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}}
            for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_name or "call"
    return out


def _as_openai(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               body: _Generation, options: RequestOptions) -> ParsedTurn:
    """The turn an OpenAI chat request of ``messages`` would be, with ``body``'s sampling."""
    sampling = _sampling(body.options, options)
    top_k = sampling.pop("top_k")
    response_format = _response_format(body)
    chat = {"model": model, "messages": messages, **sampling, **({"tools": tools} if tools else {}),
            **({"response_format": response_format} if response_format else {}),
            **({"logprobs": body.logprobs} if body.logprobs is not None else {}),
            **({"top_logprobs": body.top_logprobs} if body.top_logprobs else {})}
    parsed = openai.parse_request(chat, options)
    return replace(parsed, stream=body.stream, session_id=body.session_id,
                   sampling=replace(parsed.sampling, top_k=top_k))


def parse_chat(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate an ``/api/chat`` body.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(OllamaChatBody, body)
    _common_refusals(parsed)
    if not parsed.messages:
        raise _refuse("messages", "at least one message is required")
    messages = [_openai_message(m, f"messages.{i}") for i, m in enumerate(parsed.messages)]
    return _as_openai(parsed.model, messages, parsed.tools, parsed, options)


def parse_generate(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate an ``/api/generate`` body: its ``system`` and ``prompt`` as a chat.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(OllamaGenerateBody, body)
    _common_refusals(parsed)
    for name, why in (("context", "continuing from a token array is not supported; send the whole prompt, or "
                                  "use /api/chat (the server keeps the conversation's cache warm)"),
                      ("suffix", "fill-in-the-middle is not supported"),
                      ("template", "the model's own chat template is used; a template cannot be given"),
                      ("images", "image input is not supported: the served models are text-only")):
        if getattr(parsed, name):
            raise _refuse(name, why)
    if parsed.raw:
        raise _refuse("raw", "raw prompts are not supported: the prompt goes through the model's chat template")
    if not parsed.prompt:
        raise _refuse("prompt", "must not be empty")
    messages = [{"role": "system", "content": parsed.system}] if parsed.system else []
    messages.append({"role": "user", "content": parsed.prompt})
    return _as_openai(parsed.model, messages, None, parsed, options)


def is_load_only(body: Any) -> bool:
    """Whether ``body`` only asks for the model to be loaded (Ollama's empty prompt or no
    messages): answered at once with ``done_reason`` "load"."""
    if not isinstance(body, dict):
        return False
    return not body.get("messages") and not body.get("prompt") and not body.get("context")


def timestamp(now: float) -> str:
    """``created_at``: RFC 3339 in UTC."""
    return datetime.fromtimestamp(now, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def stats(finished: Finished) -> dict[str, Any]:
    """The final object's counts and durations (nanoseconds)."""
    return {"total_duration": _ns(finished.total_s), "load_duration": _ns(finished.restore_s),
            "prompt_eval_count": max(1, finished.n_prompt_tokens - finished.n_cached_tokens),
            "prompt_eval_duration": _ns(finished.prefill_s), "eval_count": finished.n_output_tokens,
            "eval_duration": _ns(finished.total_s - finished.ttft_s)}


def done_reason(finished: Finished) -> str:
    return "length" if finished.stop_reason == "max_tokens" else "stop"


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as JSON text) in Ollama's shape (arguments as an object)."""
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]


def chat_message(openai_message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message (``openai.reply_message``'s shape) as Ollama writes it."""
    message = {"role": "assistant", "content": openai_message.get("content") or ""}
    if openai_message.get("tool_calls"):
        message["tool_calls"] = _tool_calls(openai_message["tool_calls"])
    return message


def _logprobs(parsed: ParsedTurn, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``logprobs`` (asked for): each token's, OpenAI's entry shape, which Ollama's is."""
    return {"logprobs": [openai.logprob_entry(e) for e in entries]} if parsed.sampling.logprobs is not None else {}


def chat_reply(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished, now: float) -> Reply:
    """The non-streamed ``/api/chat`` answer, and its message as history keeps it (OpenAI's shape)."""
    message = openai.reply_message(completion_id, parsed, text)
    return Reply((message,), body={"model": parsed.model, "created_at": timestamp(now),
                                   "message": chat_message(message), "done_reason": done_reason(finished),
                                   "done": True, **stats(finished), **_logprobs(parsed, finished.logprobs)})


def generate_reply(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished, now: float) -> Reply:
    """The non-streamed ``/api/generate`` answer (no ``context``: see ``parse_generate``), and
    the reply as history keeps it (OpenAI's shape)."""
    return Reply((openai.reply_message(completion_id, parsed, text),),
                 body={"model": parsed.model, "created_at": timestamp(now), "response": text,
                       "done_reason": done_reason(finished), "done": True, **stats(finished),
                       **_logprobs(parsed, finished.logprobs)})


def render_load(model: str, chat: bool, now: float) -> dict[str, Any]:
    """The answer to a request that only loads the model."""
    reply = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": timestamp(now), **reply, "done_reason": "load", "done": True}


def render_lines(completion_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent], chat: bool,
                 clock: Any) -> Iterator[dict[str, Any] | Reply]:
    """Engine events -> the stream's objects: ``done: false`` ones with the reply's text
    (``message`` for chat, ``response`` for generate; tool calls whole, once parsed), then
    the ``done: true`` one with the reason and the stats; the ``Reply`` (OpenAI's message)
    as ``openai.render_chunks`` gives it. ``clock()`` is the time now."""
    finished: list[Finished] = []

    def kept() -> Iterator[GenerationEvent]:
        for event in events:
            if isinstance(event, Finished):
                finished.append(event)
            yield event

    for chunk in openai.render_chunks(completion_id, parsed, kept()):
        if isinstance(chunk, Reply):
            yield chunk
            continue
        if not isinstance(chunk, dict) or not chunk["choices"]:
            continue  # a keep-alive (NDJSON has no comments), [DONE]
        delta = chunk["choices"][0]["delta"]
        content, calls = delta.get("content") or "", delta.get("tool_calls")
        entries = (chunk["choices"][0].get("logprobs") or {}).get("content")
        if not content and not calls and not entries:
            continue
        line: dict[str, Any] = {"model": parsed.model, "created_at": timestamp(clock())}
        if chat:
            line["message"] = {"role": "assistant", "content": content,
                               **({"tool_calls": _tool_calls(calls)} if calls else {})}
        else:
            line["response"] = content
        yield {**line, "done": False, **({"logprobs": entries} if entries else {})}
    if finished:
        last = finished[-1]
        reply = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        yield {"model": parsed.model, "created_at": timestamp(clock()), **reply, "done_reason": done_reason(last),
               "done": True, **stats(last)}


def render_error(status: int, message: str) -> dict[str, Any]:
    """Ollama's error body (any status)."""
    return {"error": message}
