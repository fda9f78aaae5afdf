"""CacheRecord: what is in a KV cache, token by token (SPEC Invariant 1); ConversationCache:
a conversation's cache as it stands after a turn. Pure.

For the tokens whose keys and values are in the cache, in order: the ids fed
to the model, the exact text they spell in the rendered conversation, and the
character offset in that text at which each token ends. Tokens that split one
character (byte-level BPE emitting half an emoji) all end where that
character ends, so ``ends`` is non-decreasing and the first ``k`` tokens always
spell exactly ``text[:ends[k-1]]``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.cache.hashing import BLOCK_TOKENS

if TYPE_CHECKING:
    from app.cache.blocks import KVBlock
    from app.cache.checkpoints import Checkpoint
    from app.types import ForkPoint


@dataclass(frozen=True, slots=True)
class CacheRecord:
    tokens: tuple[int, ...]
    text: str
    ends: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.ends), "one end per token"
        assert all(a <= b for a, b in zip(self.ends, self.ends[1:])), "ends must not decrease"
        assert not self.ends or self.ends[-1] == len(self.text), "the tokens spell the whole text"

    @classmethod
    def empty(cls) -> CacheRecord:
        return cls((), "", ())

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def n_tokens_within(self, n_chars: int) -> int:
        """How many leading tokens end at or before character ``n_chars``."""
        return bisect_right(self.ends, n_chars)

    def truncate(self, n_tokens: int) -> CacheRecord:
        """The record of the first ``n_tokens`` tokens."""
        if n_tokens >= self.n_tokens:
            return self
        end = self.ends[n_tokens - 1] if n_tokens else 0
        return CacheRecord(self.tokens[:n_tokens], self.text[:end], self.ends[:n_tokens])

    def extend(self, tokens: Sequence[int], text: str, ends: Sequence[int]) -> CacheRecord:
        """Append tokens spelling ``text``; ``ends`` are offsets within ``text``."""
        base = len(self.text)
        return CacheRecord(self.tokens + tuple(tokens), self.text + text,
                           self.ends + tuple(base + e for e in ends))


def fork_cut(text: str, point: ForkPoint) -> int:
    """The character offset in a cache's ``text`` before which a fork keeps it: where the
    first left-out message's text starts, or where the last kept text found ends.

    Each text is searched after the previous one's match; a search can only match at or
    before the message's own place (its place comes after the previous message's), so the
    cut is never past the left-out message: a text not found stops the search there."""
    at = 0
    for kept in point.kept:
        found = text.find(kept, at) if kept else at
        if found < 0:
            return at
        at = found + len(kept)
    found = text.find(point.dropped, at) if point.dropped else -1
    return found if found >= 0 else at


@dataclass(frozen=True)
class ConversationCache:
    """A conversation's cache as it stands after a turn: the record, its full blocks
    (by id, in order), its private partial block and, in a hybrid model, the checkpoints
    of its recurrent state (``checkpoints.py``), oldest first.

    ``salt``: set if some of its KV data (or state) is an imported archive's, which this
    home did not compute: the import's salt (``hashing.private_fingerprint``). The blocks
    its later turns fill chain from that private fingerprint, so nothing the archive wrote,
    nor anything computed on top of it, gets an id another agent's prompt hashes to. It
    stays with the conversation: its later records, forks and exports."""

    agent_id: str
    conversation_id: str
    record: CacheRecord
    chain: tuple[str, ...]
    tail: KVBlock | None
    checkpoints: tuple[Checkpoint, ...] = ()
    salt: str | None = None

    @property
    def private_bytes(self) -> int:
        return (self.tail.nbytes if self.tail else 0) + sum(p.nbytes for p in self.checkpoints)

    @property
    def n_grouped(self) -> int:
        """Tokens whose keys are quantized (per-channel keys: all but the newest, in the tail)."""
        return len(self.chain) * BLOCK_TOKENS + (self.tail.n_grouped if self.tail else 0)
