"""OpenAI (legacy) completions, ``POST /v1/completions``: a raw prompt continued, as editors
use for code completion. Parse requests, render responses and chunks. Pure.

The prompt is the model's input as it is: no chat template, and no special tokens
neutralized (the client writes the whole prompt). ``suffix`` asks for fill-in-the-middle:
the engine writes the prompt in the model's FIM form when its vocabulary has the tokens
(``app.engine.prompting.render_completion``), else the request is a 400. A completion is
an agent's turn like any other: history keeps the prompt and the text, and the cache is
reused as for chat (``session_id``, ``ttl``, ``cache_mode``, ``speculate`` as in
``app.protocol.openai``). What it cannot honour is a 400 naming the field: several prompts
or choices, ``echo``, ``best_of``, ``logprobs``, ``logit_bias`` and non-zero penalties.
``seed`` makes sampling reproducible, as on the chat API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest
from app.protocol.openai import FINISH_REASONS, usage
from app.protocol.reply import Reply
from app.protocol.turn import CacheMode, Completion, ParsedTurn, content_digest
from app.protocol.validation import ModelName, validate
from app.types import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TTL_SECONDS,
    Finished,
    Heartbeat,
    RequestOptions,
    SamplingParams,
    Started,
    TextDelta,
)

DEFAULT_MAX_TOKENS = 16  # the API's own default for a completion


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class CompletionBody(_Strict):
    model: ModelName
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    best_of: int = Field(default=1, ge=1)
    echo: bool = False
    logprobs: int | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    session_id: str | None = None
    cache_mode: CacheMode = "full"
    ttl: int | None = Field(default=None, ge=0, le=MAX_TTL_SECONDS)
    speculate: bool = True


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def _refuse_unsupported(body: CompletionBody) -> None:
    refused = [
        ("n", body.n > 1, "one completion per request"),
        ("best_of", body.best_of > 1, "one completion per request"),
        ("echo", body.echo, "the prompt is not echoed"),
        ("logprobs", body.logprobs is not None, "log probabilities are not returned"),
        ("logit_bias", bool(body.logit_bias), "logit biases are not supported"),
        ("presence_penalty", body.presence_penalty != 0, "presence penalties are not supported (the server's "
                                                         "repetition_penalty setting applies)"),
        ("frequency_penalty", body.frequency_penalty != 0, "frequency penalties are not supported (the server's "
                                                           "repetition_penalty setting applies)"),
    ]
    for where, is_set, why in refused:
        if is_set:
            raise InvalidRequest(f"{where}: {why}", where)


def parse_request(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate a decoded JSON body.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(CompletionBody, body)
    _refuse_unsupported(parsed)
    prompts = [parsed.prompt] if isinstance(parsed.prompt, str) else parsed.prompt
    if len(prompts) != 1:
        raise InvalidRequest("prompt: one prompt per request (a string, or a list of one)", "prompt")
    prompt = prompts[0]
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", "prompt")
    stops = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"stop: at most {MAX_STOP_SEQUENCES} sequences of {MAX_STOP_CHARS} characters", "stop")
    limit = parsed.max_tokens or DEFAULT_MAX_TOKENS
    if limit > options.max_output_tokens:
        raise InvalidRequest(f"max_tokens: {limit} > {options.max_output_tokens}, the maximum allowed", "max_tokens")
    sampling = SamplingParams(
        temperature=options.default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        max_tokens=limit, stop_sequences=stops, speculate=parsed.speculate, seed=parsed.seed)
    return ParsedTurn(parsed.model, (), sampling, parsed.stream, parsed.session_id,
                      ({"role": "user", "content": prompt},),
                      include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                      ttl_seconds=parsed.ttl, cache_mode=parsed.cache_mode,
                      system_digest=content_digest("suffix", parsed.suffix or ""),
                      message_digests=(content_digest("user", prompt),), parts=(("prompt", prompt),),
                      completion=Completion(prompt, parsed.suffix))


def message_digest(message: dict[str, Any]) -> str:
    return content_digest(str(message["role"]), str(message["content"]))


def _history(text: str) -> tuple[dict[str, Any]]:
    """The continuation as history keeps it: an assistant message of its text."""
    return ({"role": "assistant", "content": text},)


def whole_reply(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> Reply:
    """The non-streaming reply: its body and what history keeps."""
    return Reply(_history(text), body={
        "id": completion_id, "object": "text_completion", "created": int(time.time()), "model": parsed.model,
        "choices": [{"text": text, "index": 0, "logprobs": None,
                     "finish_reason": FINISH_REASONS[finished.stop_reason]}],
        "usage": usage(finished)})


def render_chunks(completion_id: str, parsed: ParsedTurn,
                  events: Iterator[Started | TextDelta | Finished | Heartbeat],
                  ) -> Iterator[dict[str, Any] | str | Heartbeat | Reply]:
    """Engine events -> ``text_completion`` chunks, then the ``[DONE]`` marker; a heartbeat as it
    came; once generation finished, the ``Reply`` the chunks sent, before the last one."""
    created = int(time.time())
    texts: list[str] = []

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        return {"id": completion_id, "object": "text_completion", "created": created, "model": parsed.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    for event in events:
        if isinstance(event, Heartbeat):
            yield event
        elif isinstance(event, TextDelta):
            if event.text:
                texts.append(event.text)
                yield chunk(event.text, None)
        elif isinstance(event, Finished):
            yield Reply(_history("".join(texts)))
            yield chunk("", FINISH_REASONS[event.stop_reason])
            if parsed.include_usage:
                yield {"id": completion_id, "object": "text_completion", "created": created, "model": parsed.model,
                       "choices": [], "usage": usage(event)}
    yield "[DONE]"
