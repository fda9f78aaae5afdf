"""Chat template -> exact prompt text -> token ids. The tokenizer is passed in.

The template is rendered to text first and that text is tokenized without
adding special tokens (the template writes BOS itself where the model wants
it), so the text and the ids always describe the same prompt.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError

from app.errors import ContextTooLong, InvalidRequest
from app.types import ChatMessage, Prompt

# Every text a request brings is data, not structure: only the chat template's own markup
# becomes special tokens. A user or a tool result that writes "<|im_end|>" must not end its
# turn, and neither may system text (it carries CLAUDE.md, git status and third parties' tool
# descriptions), tool schemas, calls' arguments or earlier assistant text (llama.cpp tokenizes
# such content with special tokens off). A special token's string in any of them gets ``BREAK``
# after its first character, so the tokenizer reads it as the plain text it looks like (a
# zero-width joiner: invisible, and rare in real text).
BREAK = "\u2060"


@lru_cache(maxsize=8)
def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """One pattern for every special-token string of a (Hugging Face) tokenizer, longest first."""
    specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                if t.special and len(t.content) > 1}
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def neutralize(tokenizer: Any, text: str) -> str:
    """``text`` with every special-token string the tokenizer knows broken by ``BREAK``."""
    pattern = _special_pattern(getattr(tokenizer, "_tokenizer", tokenizer))
    if pattern is None:
        return text
    return pattern.sub(lambda m: m.group(0)[0] + BREAK + m.group(0)[1:], text)


def neutralize_all(tokenizer: Any, value: Any) -> Any:
    """A JSON-like value (a tool's definition, a call's arguments) with ``neutralize`` applied
    to every string in it, keys included."""
    if isinstance(value, str):
        return neutralize(tokenizer, value)
    if isinstance(value, dict):
        return {neutralize_all(tokenizer, k): neutralize_all(tokenizer, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [neutralize_all(tokenizer, v) for v in value]
    return value


ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def template_call_id(client_id: str) -> str:
    """The id a template is given for a call (and the result answering it): 9 letters and
    digits derived from the client's id, the one shape every template accepts (Mistral's
    refuse any other), and the same every turn."""
    number = int.from_bytes(hashlib.sha256(client_id.encode()).digest()[:8], "big")
    return "".join(ID_ALPHABET[(number >> (6 * i)) % len(ID_ALPHABET)] for i in range(9))


def template_messages(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: calls as OpenAI-style ``tool_calls`` (the text
    before them without trailing whitespace: templates put their own separator there), a
    ``tool`` result with the id and name of the call it answers, every text of every role
    neutralized (only the template's own markup is special)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": neutralize(tokenizer, m.content)}
        if m.tool_calls:
            entry["content"] = entry["content"].rstrip()
            entry["tool_calls"] = [{"id": template_call_id(c.id), "type": "function",
                                    "function": {"name": neutralize(tokenizer, c.name),
                                                 "arguments": neutralize_all(tokenizer, c.arguments)}}
                                   for c in m.tool_calls]
            names.update((c.id, neutralize(tokenizer, c.name)) for c in m.tool_calls)
        if m.role == "tool":
            entry["tool_call_id"] = template_call_id(m.tool_call_id)
            if m.tool_call_id in names:
                entry["name"] = names[m.tool_call_id]
        out.append(entry)
    return out


def _apply_template(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; it cannot serve chat requests")
    try:
        return tokenizer.apply_chat_template(template_messages(tokenizer, messages),
                                             tools=[neutralize_all(tokenizer, t) for t in tools] or None,
                                             tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:
        raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}", "messages") from exc


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage], reply_prefix: str = "",
                max_tokens: int | None = None, max_token_chars: int = 1,
                tools: Sequence[dict[str, Any]] = (), prefill: str = "") -> Prompt:
    """Render ``messages`` (and ``tools``, for a template that defines them) with the
    model's chat template, ready for a reply that starts with the client's ``prefill``
    (neutralized, as its messages are) and then ``reply_prefix`` (the server's own, as is).

    With ``max_tokens``, a text that cannot fit is refused before it is tokenized
    (no token spells more than ``max_token_chars`` characters): a huge body costs
    a string length, not a tokenizer pass.

    Raises:
        InvalidRequest: the model has no chat template or it rejects the
            conversation (e.g. roles that must alternate).
        ContextTooLong: the text alone proves the prompt longer than ``max_tokens``.
    """
    text = _apply_template(tokenizer, messages, tools) + neutralize(tokenizer, prefill) + reply_prefix
    at_least = -(-len(text) // max_token_chars)
    if max_tokens is not None and at_least > max_tokens:
        raise ContextTooLong(at_least, max_tokens)
    return Prompt(text, *tokenize_with_ends(tokenizer, text))


# Fill-in-the-middle tokens a vocabulary may have, each set in prefix-suffix-middle order
# (StarCoder and SmolLM-style, then Qwen2.5-Coder-style).
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle tokens, if its vocabulary has a set of them."""
    vocabulary = tokenizer.get_vocab()
    return next((names for names in FIM_TOKENS if all(name in vocabulary for name in names)), None)


def _leading_special(tokenizer: Any) -> str:
    """What the tokenizer puts before a text it encodes alone (a BOS), as text; "" for none."""
    alone, bare = tokenizer.encode("x"), tokenizer.encode("x", add_special_tokens=False)
    extra = len(alone) - len(bare)
    return str(tokenizer.decode(alone[:extra])) if extra > 0 and alone[extra:] == bare else ""


def render_completion(tokenizer: Any, prompt: str, suffix: str | None = None, max_tokens: int | None = None,
                      max_token_chars: int = 1) -> Prompt:
    """A raw prompt as the model reads it: the tokenizer's own start (a BOS where it adds
    one) and the text, special tokens included (the client writes the whole prompt); with
    ``suffix``, in the model's fill-in-the-middle form (prefix, suffix, then the middle to
    generate).

    Raises:
        InvalidRequest: a suffix for a model without fill-in-the-middle tokens.
        ContextTooLong: the text alone proves the prompt longer than ``max_tokens``.
    """
    if suffix is not None:
        fim = fim_tokens(tokenizer)
        if fim is None:
            raise InvalidRequest("suffix: the served model has no fill-in-the-middle tokens", "suffix")
        prompt = f"{fim[0]}{prompt}{fim[1]}{suffix}{fim[2]}"
    text = _leading_special(tokenizer) + prompt
    at_least = -(-len(text) // max_token_chars)
    if max_tokens is not None and at_least > max_tokens:
        raise ContextTooLong(at_least, max_tokens)
    return Prompt(text, *tokenize_with_ends(tokenizer, text))


SENTINEL = "\x00semantic:first-user-message\x00"


def render_conversation_start(tokenizer: Any, system: str) -> Prompt | None:
    """The text every conversation with this system prompt starts with: the
    template rendered up to where the first user message's content begins.

    None if the template transforms message contents (no safe cut point).
    """
    text = _apply_template(tokenizer, [ChatMessage("system", system), ChatMessage("user", SENTINEL)])
    cut = text.find(SENTINEL)
    if cut <= 0:
        return None
    return Prompt(text[:cut], *tokenize_with_ends(tokenizer, text[:cut]))


def tokenize_with_ends(tokenizer: Any, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token ids of ``text`` (no special tokens added) and where each ends in it.

    Ends come from the tokenizer's offset mapping; tokens sharing one character
    (byte-level pieces of an emoji) all end at that character's end.
    """
    encoding = tokenizer._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ends, furthest = [], 0
    for _, end in encoding.offsets:
        furthest = max(furthest, end)
        ends.append(furthest)
    return tuple(encoding.ids), tuple(ends)


def check_fits(prompt: Prompt, context_length: int) -> None:
    """Reject a prompt that leaves no room for one output token.

    Raises:
        ContextTooLong: with Anthropic's "prompt is too long" wording.
    """
    maximum = context_length - 1
    if prompt.n_tokens > maximum:
        raise ContextTooLong(prompt.n_tokens, maximum)
