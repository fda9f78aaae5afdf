"""Invariants 1 and 2 over real tokenizers and real rendered conversations.

For random conversations split at random points (mid-word edits, CRLF, emoji,
combining marks): a cache record built the way the engine builds it (prompt
tokens by offsets, generated tokens by their bytes) spells its text, and the
reused tokens plus the rest of the prompt are exactly the prompt's own cold
tokenization, for both shipped tokenizers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from app.cache.matcher import match_prompt
from app.cache.records import CacheRecord
from app.engine.prompting import tokenize_with_ends
from app.engine.token_text import TextTracker, TokenBytes, spells
from app.types import Prompt

PIECES = ["Hello!", "line\r\nbreak", "interna", "tionalization", " world", "def f(x):\n    return x ** 2\n", "ünïcödé", " 🙂🚀", "  two  spaces ",
          "\n\n", "3.14159", "日本語のテキスト", "<b>bold</b>", "I'm sure we'll", "\ttab", "x" * 20,
          "{\"k\": [1, 2]}", "é\u0301", "end."]
TEXT = st.lists(st.sampled_from(PIECES), min_size=1, max_size=5).map("".join)
EOT = {"smollm2-135m-instruct": "<|im_end|>", "gemma3-270m": "<end_of_turn>"}


class Model:
    def __init__(self, path: Path) -> None:
        self.tokenizer = load_tokenizer(path)
        self.bytes = TokenBytes.from_tokenizer_json(path / "tokenizer.json")
        self.eot = self.tokenizer._tokenizer.convert_tokens_to_ids(EOT[path.name])

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_record(self, text: str) -> CacheRecord:
        ids, ends = tokenize_with_ends(self.tokenizer, text)
        return CacheRecord(ids, text, ends)

    def generated(self, record: CacheRecord, reply: str) -> CacheRecord:
        """As the engine records a generated reply: tokens, then their decoded text."""
        tracker = TextTracker(self.bytes)
        tokens = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eot]
        for token in tokens:
            tracker.add(token)
        tracker.finish()
        return record.extend(tokens, tracker.text, tracker.ends)


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def model(request: pytest.FixtureRequest) -> Model:
    return Model(request.getfixturevalue("smollm2_dir" if request.param.startswith("smol") else "gemma3_dir"))


def conversation(texts: list[str]) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def check_reuse(model: Model, record: CacheRecord, text: str) -> int:
    """Match ``text`` against ``record`` as the engine does; the reused tokens plus the
    prompt's own remaining tokens are the cold tokenization, and reuse goes as far as it can."""
    assert spells(model.bytes, record.tokens, record.text)
    prompt = Prompt(text, *tokenize_with_ends(model.tokenizer, text))
    match = match_prompt(record, prompt)
    n = match.n_reused
    assert record.tokens[:n] == prompt.token_ids[:n], "warm keeps only tokens cold computes too"
    assert n < prompt.n_tokens, "at least one token is always prefilled"
    start = record.ends[n - 1] if n else 0
    combined = record.truncate(n).extend(prompt.token_ids[n:], text[start:], [e - start for e in prompt.ends[n:]])
    assert (combined.text, combined.tokens, combined.ends) == (text, prompt.token_ids, prompt.ends)
    assert n == min(_shared_tokens(record.tokens, prompt.token_ids), prompt.n_tokens - 1), \
        "nothing a cold prefill shares is left unused"
    return n


def _shared_tokens(cached: tuple[int, ...] | list[int], cold: tuple[int, ...]) -> int:
    """The oracle, by brute force and independent of the matcher's own helpers: how many
    leading tokens the cache and the prompt's cold tokenization have in common."""
    n = 0
    while n < len(cached) and n < len(cold) and cached[n] == cold[n]:
        n += 1
    return n


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(texts=st.lists(TEXT, min_size=3, max_size=7), data=st.data())
def test_next_turn_reuses_the_previous_turn_exactly(model: Model, texts: list[str], data: st.DataObject) -> None:
    n_first = data.draw(st.integers(0, (len(texts) - 3) // 2)) * 2 + 1  # ends on a user turn
    messages = conversation(texts)
    record = model.generated(model.prompt_record(model.render(messages[:n_first])), texts[n_first])
    next_prompt = model.render(messages[:n_first + 2])
    check_reuse(model, record, next_prompt)


@PROPERTY
@given(texts=st.lists(TEXT, min_size=1, max_size=5), data=st.data())
def test_random_split_points(model: Model, texts: list[str], data: st.DataObject) -> None:
    prompt = model.render(conversation(texts))
    cut = data.draw(st.integers(0, len(prompt)))
    edited = data.draw(st.booleans())
    cached_text = prompt[:cut] + ("EDITED" if edited else "")
    check_reuse(model, model.prompt_record(cached_text) if cached_text else CacheRecord.empty(), prompt)


def test_exact_repeat_reuses_all_but_one_token(model: Model) -> None:
    prompt = model.render(conversation(["What is 2+2?"]))
    record = model.prompt_record(prompt)
    assert check_reuse(model, record, prompt) == record.n_tokens - 1
    assert match_prompt(record, Prompt(prompt, record.tokens, record.ends)).reason == "exact"


def test_a_mid_word_edit_reuses_only_what_cold_tokenizes_alike(model: Model) -> None:
    """The issue's case: the stored prompt asked for 'internationalization', the new one
    says 'internationally': the kept tokens end before the word the two tokenize apart."""
    stored = model.render(conversation(["Please write the word internationalization is long"]))
    text = model.render(conversation(["Please write the word internationally speaking"]))
    record = model.prompt_record(stored)
    n = check_reuse(model, record, text)
    within = record.n_tokens_within(len(os.path.commonprefix([record.text, text])))
    cold = tokenize_with_ends(model.tokenizer, text)[0]
    if record.tokens[:within] != cold[:within]:  # the shared characters end inside a token cold splits otherwise
        assert n < within
    assert n >= record.n_tokens_within(record.text.index("internation"))  # everything before the word is kept


def test_non_canonical_reply_tokens_are_not_reused(model: Model) -> None:
    """A reply generated as non-canonical tokens ('Hel' + 'lo' where the tokenizer
    would write 'Hello') re-tokenizes differently next turn: reuse stops where the
    two part, since a cold prefill of the next prompt never sees 'Hel' + 'lo'."""
    first = model.render(conversation(["Say hello."]))
    reply = "Hello there, general Kenobi"
    record = model.prompt_record(first)
    pieces = [model.tokenizer.encode(ch, add_special_tokens=False) for ch in reply]
    tokens = [t for piece in pieces for t in piece] + [model.eot]
    tracker = TextTracker(model.bytes)
    for token in tokens:
        tracker.add(token)
    record = record.extend(tokens, tracker.text, tracker.ends)
    next_prompt = model.render(conversation(["Say hello.", reply, "Again."]))
    cold_tokens = tokenize_with_ends(model.tokenizer, next_prompt)[0]
    token_level = next(i for i, (a, b) in enumerate(zip(record.tokens, cold_tokens)) if a != b)
    assert check_reuse(model, record, next_prompt) == token_level < record.n_tokens
