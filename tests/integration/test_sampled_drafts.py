"""Exact speculative sampling hands out tokens with the model's own distribution.

Fixed distributions stand in for the model: row ``i`` is the distribution of the token
at draft position ``i`` given that the tokens before it are the draft's. Over many
verifications (a seeded generator), the first token handed out must follow row 0, the
second, among verifications whose first token was the draft's, row 1, and so on: every
token's count within 5 standard deviations of its binomial expectation (a correct rule
fails about once in a million runs per token; the usual mistakes, accepting every draft
token or drawing from ``p`` itself after a rejection, miss by dozens).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from app.engine.sampled_drafts import accept_sampled, token_distribution

TRIALS = 20_000
ROWS = np.array([[0.50, 0.30, 0.15, 0.05],
                 [0.10, 0.20, 0.30, 0.40],
                 [0.25, 0.25, 0.25, 0.25]])


def handed_out(probs: np.ndarray, draft: list[int], seed: int = 0) -> list[list[int]]:
    """The tokens each of ``TRIALS`` verifications hands out: the accepted draft, then the next token."""
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(TRIALS):
        n, after = accept_sampled(probs, draft, rng)
        runs.append([*draft[:n], after])
    return runs


def assert_follows(tokens: list[int], expected: np.ndarray) -> None:
    observed = np.bincount(tokens, minlength=len(expected))
    support = expected > 0
    assert observed[~support].sum() == 0, "a token of probability 0 was handed out"
    n = len(tokens)
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(observed - n * expected)[support] <= 5 * sigma[support] + 1e-9), (observed, n * expected)


@pytest.mark.parametrize("draft", [[1, 3], [0, 2], [3, 0]])
def test_every_position_has_the_models_distribution(draft: list[int]) -> None:
    runs = handed_out(ROWS, draft)
    assert_follows([run[0] for run in runs], ROWS[0])
    kept = [run for run in runs if run[0] == draft[0]]
    assert_follows([run[1] for run in kept], ROWS[1])
    both = [run for run in kept if run[1] == draft[1]]
    assert_follows([run[2] for run in both], ROWS[2])


def test_a_draft_token_is_kept_with_its_probability() -> None:
    runs = handed_out(ROWS[:2], [1])
    kept = sum(len(run) == 2 for run in runs) / TRIALS  # the draft token held, then one more
    assert abs(kept - ROWS[0, 1]) < 5 * np.sqrt(0.3 * 0.7 / TRIALS)


def test_certain_and_impossible_draft_tokens() -> None:
    sure = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert all(run[0] == 1 and len(run) == 2 for run in handed_out(sure, [1])[:500])
    never = np.array([[0.6, 0.0, 0.4], [0.2, 0.3, 0.5]])
    assert all(len(run) == 1 and run[0] != 1 for run in handed_out(never, [1])[:500])


def test_token_distribution_is_what_the_sampler_draws_from() -> None:
    assert token_distribution(0.0) is None
    logits = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs = np.array(token_distribution(0.5)(logits))[0]
    expected = np.exp(np.array(logits[0]) / 0.5)
    assert np.allclose(probs, expected / expected.sum(), atol=1e-6)
    top2 = np.array(token_distribution(1.0, top_k=2)(logits))[0]
    assert np.allclose(top2, [np.e / (np.e + 1), 1 / (np.e + 1), 0, 0, 0], atol=1e-6)
