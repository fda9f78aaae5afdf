"""Draft tokens for speculative decoding, looked up in the conversation itself. Pure.

Agent replies copy what is already in the context: a file shown in the prompt
re-emitted with one change, a tool call quoting paths, a diff. Prompt lookup
("n-gram") drafting guesses the next tokens by finding the reply's last few
tokens earlier in the conversation (prompt and reply so far) and proposing what
followed them there. The model then checks the whole guess in one forward pass
(``speculation.py``); a wrong guess costs that pass's extra rows, never a
different answer.

``PromptLookup`` keeps, for every n-gram of ``min_ngram``..``max_ngram`` tokens,
where it last occurred, so a lookup is one dictionary probe per n (longest
first) and a new token costs ``max_ngram`` dictionary writes. ``DraftLength``
adapts how many tokens to propose to how many were accepted lately, and backs
off after misses, so prose (where guesses rarely hold) costs almost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Drafter(Protocol):
    """What proposes a sequence's drafts: its history, and a guess at what follows it
    (``PromptLookup`` here; ``draft_model.ModelDraft``, a smaller model's guess)."""

    tokens: list[int]

    def extend(self, tokens: Iterable[int]) -> None: ...

    def draft(self, k: int) -> list[int]: ...


class DraftSource(Protocol):
    """Drafters of another kind than ``PromptLookup`` (a draft model: ``draft_model.DraftModel``),
    one per decoding sequence; ``key`` names its conversation, whose drafter a later turn may
    take up again after ``release``."""

    def drafter(self, history: list[int], key: str | None) -> Drafter: ...

    def release(self, key: str | None, drafter: Drafter) -> None: ...


class PromptLookup:
    """The token history of one sequence and its n-gram index.

    Args:
        tokens: the history so far (the prompt's tokens, cached ones included).
        min_ngram: the shortest suffix that may match (shorter matches guess badly).
        max_ngram: the longest suffix tried first.
    """

    def __init__(self, tokens: Iterable[int], min_ngram: int = 2, max_ngram: int = 4) -> None:
        assert 1 <= min_ngram <= max_ngram
        self._min = min_ngram
        self._max = max_ngram
        self.tokens: list[int] = []
        # (n-gram) -> the index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the history."""
        history, index = self.tokens, self._next
        for token in tokens:
            end = len(history)  # the n-grams ending just before ``token`` are now followed by it
            for n in range(self._min, min(self._max, end) + 1):
                index[tuple(history[end - n:end])] = end
            history.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the history's
        last ``max_ngram`` .. ``min_ngram`` tokens (the latest such occurrence); empty
        when none occurred or ``k`` is 0."""
        history = self.tokens
        if k <= 0:
            return []
        for n in range(min(self._max, len(history)), self._min - 1, -1):
            at = self._next.get(tuple(history[len(history) - n:]))
            if at is not None:
                return history[at:at + k]
        return []


class DraftLength:
    """How many tokens to draft next, from how the last drafts fared.

    A draft accepted whole grows the next by ``grow`` (up to ``max_tokens``); a
    partly accepted one shrinks to what was accepted plus one. A draft rejected
    at its first token also pauses drafting for ``pause`` steps, doubling with
    each such miss in a row (up to ``max_pause``): verification rows cost time,
    and where guesses keep failing, plain steps are faster.
    """

    def __init__(self, max_tokens: int, start: int = 4, grow: int = 2, max_pause: int = 16) -> None:
        self.max_tokens = max_tokens
        self.k = min(start, max_tokens)
        self._grow = grow
        self._max_pause = max_pause
        self._pause = 0  # steps left without drafting
        self._next_pause = 1
        self.drafted = 0  # tokens proposed, in total
        self.accepted = 0  # of which the model agreed with

    def want(self) -> int:
        """Tokens to draft on this step (0: take a plain step)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """Record a verified draft: ``n_accepted`` of its ``n_drafted`` tokens held."""
        if n_drafted <= 0:
            return
        self.drafted += n_drafted
        self.accepted += n_accepted
        if n_accepted == n_drafted:
            self.k = min(self.max_tokens, self.k + self._grow)
            self._next_pause = 1
        elif n_accepted == 0:
            self.k = max(1, self.k // 2)
            self._pause = self._next_pause
            self._next_pause = min(self._max_pause, self._next_pause * 2)
        else:
            self.k = max(1, n_accepted + 1)
            self._next_pause = 1
