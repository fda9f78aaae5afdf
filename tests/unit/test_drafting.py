"""Prompt-lookup drafts and their adaptive length (app/engine/drafting.py), with plain values."""

from __future__ import annotations

import random

from app.engine.drafting import DraftLength, PromptLookup


def naive_draft(history: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The definition: the longest suffix n-gram's latest earlier occurrence, what followed it."""
    for n in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        suffix = history[len(history) - n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


def test_a_copy_in_progress_is_drafted_from_the_prompt() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    lookup = PromptLookup([*prompt, 0, 3, 4])
    assert lookup.draft(4) == [5, 6, 7, 8]
    assert lookup.draft(0) == []
    lookup.extend([5, 6, 7, 8, 9])
    assert lookup.draft(4) == [0, 3, 4, 5]  # what followed the prompt's end last time
    assert PromptLookup([1, 2, 3, 9, 1, 2]).draft(4) == [3, 9, 1, 2]  # up to the history's end


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    # "2 3" occurs twice; "1 2 3" only first: the 3-gram's continuation is taken
    lookup = PromptLookup([1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 1, 2, 3])
    assert lookup.draft(2) == [10, 11]
    assert PromptLookup([1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 9, 2, 3]).draft(2) == [20, 21]  # latest 2-gram


def test_no_match_shorter_than_min_ngram() -> None:
    assert PromptLookup([5, 6, 7, 5], min_ngram=2).draft(3) == []
    assert PromptLookup([5, 6, 7, 5], min_ngram=1).draft(3) == [6, 7, 5]


def test_drafts_equal_the_definition_on_random_histories() -> None:
    rng = random.Random(7)
    for _ in range(300):
        history = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        lookup = PromptLookup(history[:rng.randrange(len(history) + 1)])
        lookup.extend(history[len(lookup):])
        k = rng.randrange(1, 9)
        assert lookup.draft(k) == naive_draft(history, k, 2, 4), history


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_partial() -> None:
    length = DraftLength(max_tokens=8, start=4)
    assert length.want() == 4
    length.update(4, 4)
    assert length.want() == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.want() == 8  # capped
    length.update(8, 2)
    assert length.want() == 3
    assert (length.drafted, length.accepted) == (26, 20)


def test_misses_in_a_row_pause_drafting_longer_each_time() -> None:
    length = DraftLength(max_tokens=8, start=4, max_pause=4)
    pauses = []
    for _ in range(4):
        length.update(length.want() or 1, 0)
        n = 0
        while length.want() == 0:
            n += 1
        pauses.append(n)
    assert pauses == [1, 2, 4, 4]
    length.update(1, 1)  # a hit resets the pause
    length.update(length.want(), 0)
    assert [length.want() for _ in range(2)][0] == 0 and length.want() > 0


def test_nothing_drafted_changes_nothing() -> None:
    length = DraftLength(max_tokens=8)
    length.update(0, 0)
    assert length.want() == 4 and length.drafted == 0
