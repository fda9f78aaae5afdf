"""Invariants 1 and 2 over real tokenizers and real rendered conversations.

For random conversations split at random points: a cache record built the way
the engine builds it (prompt tokens by offsets, generated tokens by their
bytes) spells its text, and reused tokens plus the suffix tokenized alone
spell the next prompt exactly, for both shipped tokenizers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from app.cache.matcher import match_prompt
from app.cache.records import CacheRecord
from app.engine.prompting import tokenize_with_ends
from app.engine.token_text import TextTracker, TokenBytes, spells

PIECES = ["Hello!", " world", "def f(x):\n    return x ** 2\n", "ünïcödé", " 🙂🚀", "  two  spaces ",
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


def check_reuse(model: Model, record: CacheRecord, prompt: str) -> int:
    assert spells(model.bytes, record.tokens, record.text)
    match = match_prompt(record, prompt)
    start = record.ends[match.n_reused - 1] if match.n_reused else 0
    suffix_ids, suffix_ends = tokenize_with_ends(model.tokenizer, prompt[start:])
    reused = record.tokens[:match.n_reused]
    assert spells(model.bytes, reused + suffix_ids, prompt), (match, prompt[start:start + 40])
    assert suffix_ids, "at least one token is always prefilled"
    combined = record.truncate(match.n_reused).extend(suffix_ids, prompt[start:], suffix_ends)
    assert combined.text == prompt
    return match.n_reused


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(texts=st.lists(TEXT, min_size=3, max_size=7), data=st.data())
def test_next_turn_reuses_the_previous_turn_exactly(model: Model, texts: list[str], data: st.DataObject) -> None:
    n_first = data.draw(st.integers(0, (len(texts) - 3) // 2)) * 2 + 1  # ends on a user turn
    messages = conversation(texts)
    record = model.generated(model.prompt_record(model.render(messages[:n_first])), texts[n_first])
    next_prompt = model.render(messages[:n_first + 2])
    n_reused = check_reuse(model, record, next_prompt)
    if next_prompt.startswith(record.text):
        assert n_reused == record.n_tokens  # EXTEND keeps everything, the reply included


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
    assert match_prompt(record, prompt).outcome == "exact"


def test_bpe_boundary_reuse_beats_token_matching(model: Model) -> None:
    """A reply generated as non-canonical tokens ('Hel' + 'lo' where the tokenizer
    would write 'Hello') re-tokenizes differently next turn; characters still match."""
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
    n_reused = check_reuse(model, record, next_prompt)
    assert token_level < n_reused == record.n_tokens
