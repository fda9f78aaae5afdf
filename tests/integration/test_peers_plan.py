"""The side-by-side benchmark's conversation (benchmarks/peers.py), measured with SmolLM2's
own tokenizer and chat template: every server must get turns of the sizes it promises."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.peers import REPLY_TOKENS, plan, text_of


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def new_tokens_per_turn(tokenizer, system: str, users: list[str], reply: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(prompt tokens, tokens a server that kept the previous prompt and its reply must prefill) per turn,
    the reply of each turn being ``reply`` cut at max_tokens (no end-of-turn token generated)."""
    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    history = [{"role": "system", "content": system}]
    cached, out = 0, []
    for user in users:
        history.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert not cached or tokens(prompt) > cached
        out.append((tokens(prompt), tokens(prompt) - cached))
        cached = tokens(prompt + reply)
        history.append({"role": "assistant", "content": reply})
    return out


def test_turns_have_the_promised_sizes_through_the_real_template(tokenizer) -> None:  # type: ignore[no-untyped-def]
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    conversation = plan(count, system_tokens=1900, turn_tokens=240, max_context=6000, short_tokens=20)
    reply = text_of(random.Random(5), REPLY_TOKENS, count)
    assert count(reply) == REPLY_TOKENS
    sizes = new_tokens_per_turn(tokenizer, conversation.system, [t.user for t in conversation.turns], reply)
    labels = [t.label for t in conversation.turns]
    n_long = len(labels) - 3
    assert labels[n_long:] == [f"{n_long + 1} short", "after SIGKILL", "after SIGTERM"]
    assert [t.restart for t in conversation.turns[n_long:]] == [None, "SIGKILL", "SIGTERM"]
    assert 1900 <= sizes[0][0] <= 2200  # the ~1.9K system prompt and the first turn
    assert all(235 <= new <= 245 for _, new in sizes[1:n_long]), sizes
    assert all(15 <= new <= 25 for _, new in sizes[n_long:]), sizes
    # Long turns until the prompt passes the context, and not one more.
    assert sizes[n_long - 1][0] >= 6000 > sizes[n_long - 2][0]


def test_the_conversation_is_the_same_every_run_and_no_two_turns_share_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    first, again = plan(count, max_context=3000), plan(count, max_context=3000)
    assert first == again
    users = [t.user for t in first.turns]
    assert len(set(users)) == len(users) and first.system not in users
    assert plan(count, max_context=3000, seed=1).system != first.system
