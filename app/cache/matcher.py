"""Prefix matching of a prompt against a cache record (SPEC Invariant 2). Pure.

Two texts are compared first, by characters: that is how a conversation finds
the stored cache it continues, and where an edit parted from it. What is
reused is then cut back to a canonical boundary: the leading tokens whose ids
and ends equal the prompt's own tokenization. A reply the model generated as
pieces the tokenizer would not produce ('Hel' + 'lo' for 'Hello'), or a prompt
edited in the middle of a word, re-tokenizes differently next turn; keeping the
cached split there would hand the model a token sequence a cold prefill of the
same prompt never gives it. So the tokens after the cut are always the prompt's
own, and warm computes what cold computes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from app.cache.records import CacheRecord
from app.types import Prompt, ReuseReason


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a cache to keep for a prompt.

    ``n_reused`` tokens of the record stay in the KV cache; they are the prompt's
    first ``n_reused`` tokens, which spell its first ``n_chars`` characters.
    """

    n_reused: int
    n_chars: int
    reason: ReuseReason  # exact, extend, diverge or miss


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix (C speed via os.path.commonprefix)."""
    return len(os.path.commonprefix([a, b]))


def common_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def match_prompt(record: CacheRecord, prompt: Prompt) -> PrefixMatch:
    """Keep the record's leading tokens that a cold prefill of ``prompt`` computes too:
    inside the characters the two texts share, as long as ids and ends equal the
    prompt's own tokenization.

    At least one prompt token is always left to process (logits come from it): an
    exact repeat of the cached prompt reuses all but the last token.
    """
    if not record.tokens or not prompt.token_ids:
        return PrefixMatch(0, 0, "miss")
    matched = common_prefix_length(record.text, prompt.text)
    within = record.n_tokens_within(matched)
    n_reused = min(common_tokens(record.tokens[:within], prompt.token_ids),
                   common_tokens(record.ends[:within], prompt.ends))
    reason: ReuseReason
    if n_reused >= prompt.n_tokens:
        n_reused = prompt.n_tokens - 1  # nothing of the prompt would be left to prefill
        reason = "exact"
    elif n_reused == 0:
        return PrefixMatch(0, 0, "miss")
    elif matched == len(record.text):
        reason = "extend"
    else:
        reason = "diverge"
    return PrefixMatch(n_reused, record.ends[n_reused - 1] if n_reused else 0, reason)
