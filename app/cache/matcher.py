"""Character-level prefix matching of a prompt against a cache record (SPEC Invariant 2). Pure.

Matching compares text, not token ids: the same conversation re-tokenized
next turn can split differently at the old/new boundary (BPE merges across
it), so token-level matching misses where the text is in fact identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from app.cache.records import CacheRecord

Outcome = Literal["exact", "extend", "diverge", "shared", "miss"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a cache to keep for a prompt.

    ``n_reused`` tokens of the record stay in the KV cache; the prompt from
    character ``n_chars`` on must be tokenized and prefilled.
    """

    n_reused: int
    n_chars: int
    outcome: Outcome


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix (C speed via os.path.commonprefix)."""
    return len(os.path.commonprefix([a, b]))


def match_prompt(record: CacheRecord, prompt: str) -> PrefixMatch:
    """Keep every cached token that lies wholly inside the common prefix.

    At least one prompt token is always left to process (logits come from
    it): an exact repeat of the cached text reuses all but the last token.
    """
    if not record.tokens or not prompt:
        return PrefixMatch(0, 0, "miss")
    matched = common_prefix_length(record.text, prompt)
    n_reused = record.n_tokens_within(matched)
    if n_reused and record.ends[n_reused - 1] == len(prompt):
        n_reused -= 1  # nothing of the prompt would be left to prefill
        outcome: Outcome = "exact"
    elif n_reused == 0:
        return PrefixMatch(0, 0, "miss")
    elif matched == len(record.text):
        outcome = "extend"
    else:
        outcome = "diverge"
    return PrefixMatch(n_reused, record.ends[n_reused - 1] if n_reused else 0, outcome)
