"""Records, matching, hashing and the block pool, with plain values (no MLX)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.cache.hashing import block_hash, chain_hashes
from app.cache.matcher import common_prefix_length, match_prompt
from app.cache.pool import BlockPool, RecentWithin
from app.cache.records import CacheRecord, fork_cut
from app.types import ForkPoint, Prompt
from support.pool_check import check_pool, holds


def chars(text: str) -> CacheRecord:
    """One token per character."""
    return CacheRecord(tuple(ord(c) for c in text), text, tuple(range(1, len(text) + 1)))


def test_record_invariants_are_enforced() -> None:
    with pytest.raises(AssertionError):
        CacheRecord((1, 2), "ab", (2, 1))
    with pytest.raises(AssertionError):
        CacheRecord((1,), "ab", (1,))


def test_extend_and_truncate() -> None:
    record = CacheRecord((1, 2), "abcd", (2, 4)).extend((3,), "ef", (2,))
    assert record == CacheRecord((1, 2, 3), "abcdef", (2, 4, 6))
    assert record.truncate(2) == CacheRecord((1, 2), "abcd", (2, 4))
    assert record.truncate(0) == CacheRecord.empty()


def prompt_of(text: str) -> Prompt:
    """One token per character, as ``chars``."""
    record = chars(text)
    return Prompt(text, record.tokens, record.ends)


def test_reasons() -> None:
    record = chars("hello world")
    assert match_prompt(record, prompt_of("hello world, again")).reason == "extend"
    assert match_prompt(record, prompt_of("hello world, again")).n_reused == 11
    assert match_prompt(record, prompt_of("hello there")).reason == "diverge"
    assert match_prompt(record, prompt_of("hello there")).n_reused == 6
    exact = match_prompt(record, prompt_of("hello world"))
    assert (exact.reason, exact.n_reused) == ("exact", 10)
    assert match_prompt(record, prompt_of("goodbye")).reason == "miss"
    assert match_prompt(CacheRecord.empty(), prompt_of("x")).reason == "miss"


def test_tokens_straddling_the_match_are_dropped() -> None:
    record = CacheRecord((1, 2, 3), "abcdef", (2, 4, 6))  # tokens "ab", "cd", "ef"
    match = match_prompt(record, Prompt("abcX", (1, 7, 8), (2, 3, 4)))  # "ab", "c", "X"
    assert (match.n_reused, match.n_chars) == (1, 2)  # "cd" is only half inside


def test_reuse_stops_where_the_prompt_tokenizes_differently() -> None:
    """The same text split otherwise ("a"+"bc" cached, "ab"+"c" in the prompt's own
    tokenization): only the tokens a cold prefill would compute too are kept."""
    record = CacheRecord((1, 2, 3, 4), "xabcd", (1, 2, 4, 5))  # "x", "a", "bc", "d"
    prompt = Prompt("xabcde", (1, 9, 10, 4, 5), (1, 3, 4, 5, 6))  # "x", "ab", "c", "d", "e"
    match = match_prompt(record, prompt)
    assert (match.n_reused, match.n_chars, match.reason) == (1, 1, "extend")
    same_ids_other_ends = Prompt("xabcde", (1, 2, 3, 4, 5), (1, 2, 3, 5, 6))
    assert match_prompt(record, same_ids_other_ends).n_reused == 2


@given(st.text(max_size=40), st.text(max_size=40))
def test_reused_tokens_always_spell_a_prefix_of_the_prompt(cached: str, text: str) -> None:
    record = chars(cached)
    prompt = prompt_of(text)
    match = match_prompt(record, prompt)
    assert text.startswith(record.text[:match.n_chars])
    assert record.tokens[:match.n_reused] == prompt.token_ids[:match.n_reused]
    assert match.n_reused < len(text) or match.n_reused == 0
    assert common_prefix_length(cached, text) >= match.n_chars


CHAT = "<s>sys\n<u>Hi\n<a>Hello\n<u>user secret\n<a>"


def test_a_fork_cut_ends_before_the_first_message_left_out() -> None:
    assert fork_cut(CHAT, ForkPoint(("Hi", "Hello"), "user secret")) == CHAT.index("user secret")
    assert fork_cut(CHAT, ForkPoint((), "Hi")) == CHAT.index("Hi")  # at turn 0: the system prompt's part
    # A kept text found early (in the markup) only cuts earlier; one not found stops at the last found.
    assert fork_cut(CHAT, ForkPoint(("Hi", "u"), "user secret")) <= CHAT.index("user secret")
    assert fork_cut(CHAT, ForkPoint(("Hi", "rewritten"), "user secret")) == CHAT.index("Hi") + 2
    # The left-out message with no text, or rendered otherwise: the end of the last kept text.
    assert fork_cut(CHAT, ForkPoint(("Hi", "Hello"), "")) == CHAT.index("Hello") + 5
    assert fork_cut(CHAT, ForkPoint(("Hi", "Hello"), "not there")) == CHAT.index("Hello") + 5


@given(st.lists(st.text("ab<>", min_size=1, max_size=4), min_size=2, max_size=6), st.data())
def test_a_fork_cut_never_passes_the_message_left_out(texts: list[str], data: st.DataObject) -> None:
    """Whatever the texts (repeats, one inside another, inside the markup), the cut is at or
    before the place the first left-out message's text starts."""
    n_kept = data.draw(st.integers(0, len(texts) - 1))
    chat, starts = "", []
    for text in texts:
        chat += "<m>"
        starts.append(len(chat))
        chat += text + "</m>"
    assert fork_cut(chat, ForkPoint(tuple(texts[:n_kept]), texts[n_kept])) <= starts[n_kept]


def test_block_hashes_chain_and_salt() -> None:
    tokens = list(range(600))
    chain = chain_hashes("fp", tokens, 256)
    assert len(chain) == 2
    assert chain[1] == block_hash("fp", chain[0], tokens[256:512])
    assert chain_hashes("other", tokens, 256)[0] != chain[0]
    assert chain_hashes("fp", [9] + tokens[1:], 256)[1] != chain[1]  # the parent changes every later id


def test_pool_counts_shared_blocks_once_and_keeps_unreferenced_ones_free() -> None:
    pool = BlockPool(budget_bytes=1000)
    for block in ("s", "a", "b"):
        pool.add_block(block, 100)
    assert pool.n_free_blocks == 3  # loaded, referenced by nobody yet
    pool.assign("A", ["s", "a"], private_bytes=10)
    pool.assign("B", ["s", "b"], private_bytes=10)
    assert pool.nbytes == 3 * 100 + 20 and pool.n_free_blocks == 0
    pool.remove_owner("A", ["s", "a"])
    assert pool.n_free_blocks == 1 and holds(pool, "a")  # "a" stays cached, free; "s" is still B's
    pool.remove_owner("B", ["s", "b"])
    assert pool.n_free_blocks == 3 and pool.nbytes == 300
    check_pool(pool)
    assert pool.evict_free() == []  # within budget: kept for sharing
    pool.budget_bytes = 150
    pool.touch_block("a")
    assert pool.evict_free() == ["s", "b"]  # least recently used free blocks first
    assert pool.nbytes == 100 and holds(pool, "a")
    check_pool(pool)


def test_pool_lru_order_and_budget() -> None:
    pool = BlockPool(budget_bytes=250)
    for owner in ("A", "B", "C"):
        pool.add_block(owner.lower(), 100)
        pool.assign(owner, [owner.lower()], private_bytes=0)
    pool.touch("A")
    assert pool.over_budget()
    assert pool.evict_free() == []  # every block is referenced
    assert pool.lru_owners(keep="C") == ["B", "A"]



@dataclass(frozen=True)
class Sized:
    nbytes: int


def test_recent_values_stay_within_their_bytes_the_latest_whatever_its_size() -> None:
    """Shared checkpoints in memory (hybrid models): bounded by bytes, not by count."""
    recent: RecentWithin[Sized] = RecentWithin(budget_bytes=100)
    assert recent.keep("a", Sized(40)) == [] and recent.keep("b", Sized(40)) == []
    assert recent.get("a") == Sized(40)
    assert recent.keep("a", Sized(40)) == []  # used again: now the most recent
    assert recent.keep("c", Sized(40)) == ["b"]  # the least recently used goes
    assert (len(recent), recent.nbytes) == (2, 80) and recent.get("b") is None
    assert recent.keep("d", Sized(10)) == [] and recent.nbytes == 90  # small ones fit beside
    assert recent.keep("huge", Sized(500)) == ["a", "c", "d"]  # alone over the bound: kept alone
    assert (len(recent), recent.nbytes, recent.get("huge")) == (1, 500, Sized(500))
    assert recent.keep("huge", Sized(20)) == [] and recent.nbytes == 20  # replaced: its bytes recounted

def test_reference_counts_never_go_negative() -> None:
    pool = BlockPool(budget_bytes=10)
    pool.add_block("x", 1)
    pool.assign("A", ["x"], 0)
    pool.remove_owner("A", ["x"])
    with pytest.raises(AssertionError):
        pool.remove_owner("A", ["x"])
