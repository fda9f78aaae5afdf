"""A draft model (``draft_model``) changes the speed, never the answer, on the real SmolLM2.

Two draft models of SmolLM2's vocabulary: SmolLM2 itself (its guesses are the served
model's own, so nearly all hold) and a tiny random llama (its guesses nearly all fail, so
every step cuts rejected tokens from both caches). With either, greedy output equals the
output without drafts token for token, alone and beside a prompt-lookup-free neighbour, and
the cache handed back holds the prompt and the used tokens only. A draft model whose
vocabulary differs, or whose layers keep recurrent state, is refused at load naming why.
The server path (``SEMANTIC_DRAFT_MODEL``) is ``tests/e2e/test_draft_model_serve.py``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import greedy_sampler

from app.engine.batch import DecodeBatch, prefill
from app.engine.draft_model import DraftModel, ModelDraft, load_draft_model
from app.engine.model import LoadedModel, load_model
from app.errors import ConfigError
from support import families

FILE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(values, factor):
    """Multiply every value by factor."""
    return [v * factor for v in values]
'''
PROMPTS = {
    "copy": f"Here is utils.py:\n```python\n{FILE}```\nRepeat the whole file exactly, but rename the function add "
            "to plus.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
N_TOKENS = 40


@pytest.fixture(scope="module")
def target(smollm2_dir: Path) -> LoadedModel:
    return load_model("smollm2", smollm2_dir)


@pytest.fixture(scope="module")
def tiny_llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return families.save("llama", tmp_path_factory.mktemp("draft") / "tiny-llama", smollm2_dir)


def prompt_of(target: LoadedModel, name: str) -> list[int]:
    ids: list[int] = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[name]}],
                                                          add_generation_prompt=True)
    return ids


def decode(target: LoadedModel, names: list[str], draft: object | None, max_draft: int = 8,
           ) -> tuple[dict[str, list[int]], dict[str, list[KVCache]], dict[str, tuple[int, int]]]:
    """``names`` decoding together, greedy, ``N_TOKENS`` each: (tokens, caches handed back,
    (drafted, accepted) per sequence)."""
    batch = DecodeBatch(target.model, max_draft, drafts=None if draft is None else DraftModel(draft, 1 << 30))
    prompts = {name: prompt_of(target, name) for name in names}
    for uid, name in enumerate(names):
        cache = [KVCache() for _ in target.model.layers]
        prefill(target.model, cache, prompts[name][:-1])
        batch.add(uid, cache, prompts[name][-1], prompts[name][:-1], greedy_sampler, [], speculate=True)
    tokens: dict[str, list[int]] = {name: [] for name in names}
    while any(len(tokens[name]) < N_TOKENS for name in names):
        for uid, step in batch.step():
            tokens[names[uid]] += step
    drafts = {name: batch.drafts(uid) for uid, name in enumerate(names)}
    caches = {name: batch.remove(uid, len(tokens[name]) - N_TOKENS) for uid, name in enumerate(names)}
    for name, cache in caches.items():  # the prompt and the tokens used, as a fresh prefill computes them
        fresh = [KVCache() for _ in target.model.layers]
        prefill(target.model, fresh, [*prompts[name], *tokens[name][:N_TOKENS]])
        for a, b in zip(cache, fresh):
            assert a.offset == b.offset == len(prompts[name]) + N_TOKENS
            assert mx.allclose(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :], atol=1e-2).item(), name
    return {name: tokens[name][:N_TOKENS] for name in names}, caches, drafts


@pytest.fixture(scope="module")
def plain(target: LoadedModel) -> dict[str, list[int]]:
    """Each prompt's greedy tokens without drafts."""
    return {name: decode(target, [name], None, max_draft=0)[0][name] for name in PROMPTS}


def test_the_served_model_as_its_own_draft_keeps_nearly_every_guess(target: LoadedModel, smollm2_dir: Path,
                                                                   plain: dict[str, list[int]]) -> None:
    draft = load_draft_model(smollm2_dir, target)
    for name in PROMPTS:  # prose too: a draft model guesses where nothing is copied
        tokens, _, drafts = decode(target, [name], draft)
        drafted, accepted = drafts[name]
        assert tokens[name] == plain[name], name
        assert drafted >= N_TOKENS // 2 and accepted >= 0.8 * drafted, (name, drafted, accepted)


def test_a_draft_model_that_guesses_wrong_changes_nothing(target: LoadedModel, tiny_llama_dir: Path,
                                                          plain: dict[str, list[int]]) -> None:
    draft = load_draft_model(tiny_llama_dir, target)
    tokens, _, drafts = decode(target, list(PROMPTS), draft)  # both rows drafting side by side
    for name in PROMPTS:
        assert tokens[name] == plain[name], name
    assert sum(d for d, _ in drafts.values()) > 0  # it did draft (and the cuts after rejections were exact)


def test_its_history_and_cache_follow_cuts_and_catch_up(target: LoadedModel, smollm2_dir: Path) -> None:
    """``ModelDraft`` on its own: after rejected guesses and new history, its next draft
    is what a fresh drafter over the same history guesses."""
    draft_model = load_draft_model(smollm2_dir, target)
    history = prompt_of(target, "copy")
    drafter = ModelDraft(draft_model, history)
    first = drafter.draft(4)
    drafter.extend([first[0], 42])  # the first guess held, the second did not: 42 came instead
    drafter.extend([7, 8, 9])  # and the batch went on without drafts for a while
    fresh = ModelDraft(draft_model, [*history, first[0], 42, 7, 8, 9])
    assert drafter.draft(5) == fresh.draft(5)
    for a, b in zip(drafter._cache, fresh._cache):  # the rejected guesses are gone from its cache
        assert a.offset == b.offset == len(history) + 5 + 4
        assert mx.allclose(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :], atol=1e-4).item()
    assert drafter.draft(3) == ModelDraft(draft_model, drafter.tokens).draft(3)  # nothing new: same guess
    assert drafter.draft(0) == []


def test_a_conversations_next_turn_feeds_the_draft_model_its_new_tokens_only(
        target: LoadedModel, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DraftModel`` keeps a conversation's drafter between turns: the next turn's history
    (the reply as committed, without the token past its end, then the new user text) is fed
    from where the two part, and the guess is a fresh drafter's. The least recently released
    go while the kept caches exceed the budget, and a cache larger than all of it is not kept."""
    drafts = DraftModel(load_draft_model(smollm2_dir, target), budget_bytes=1 << 30)
    history = prompt_of(target, "copy")
    first = drafts.drafter(history, "c1")
    guess = first.draft(4)
    first.extend([guess[0], 42])  # handed out: the first guess, then a token past the turn's end
    drafts.release("c1", first)
    next_turn = [*history, guess[0], 7, 8, 9, 10]
    fresh = ModelDraft(drafts.model, next_turn)
    expected = fresh.draft(3)
    fed: list[int] = []
    feed = ModelDraft._feed
    monkeypatch.setattr(ModelDraft, "_feed", lambda self, tokens: fed.append(len(tokens)) or feed(self, tokens))
    second = drafts.drafter(next_turn, "c1")
    assert second is first
    assert second.draft(3) == expected
    assert fed == [4, 1, 1]  # the 4 new tokens, then one per guessed token
    for a, b in zip(second._cache, fresh._cache):
        assert a.offset == b.offset
        assert mx.allclose(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :], atol=1e-4).item()
    others = {f"other-{i}": ModelDraft(drafts.model, [1, 2]) for i in range(4)}
    for drafter in others.values():
        drafter.draft(1)
    small = others["other-0"].nbytes
    long_history = [1, 2] * 150
    big = ModelDraft(drafts.model, long_history)
    big.draft(1)
    assert 0 < small < big.nbytes  # caches grow in steps of 256 tokens
    drafts = DraftModel(drafts.model, budget_bytes=big.nbytes + 3 * small)  # room for big and 3 others
    drafts.release("big", big)
    for key, drafter in others.items():
        drafts.release(key, drafter)  # big goes, the least recently released: the 4 others fit
    assert drafts.kept_bytes == 4 * small
    assert drafts.drafter(long_history, "big") is not big
    drafts.release("big", big)  # other-0 goes
    assert drafts.kept_bytes == big.nbytes + 3 * small
    assert drafts.drafter([1, 2], "other-2") is others["other-2"]
    assert drafts.drafter([1, 2], "other-0") is not others["other-0"]
    assert drafts.drafter(long_history, "big") is big
    alone = DraftModel(drafts.model, budget_bytes=big.nbytes - 1)
    alone.release("big", big)  # larger than the whole budget: not kept
    assert alone.kept_bytes == 0 and alone.drafter(long_history, "big") is not big


def test_a_draft_model_of_another_vocabulary_or_with_recurrent_layers_is_refused(
        target: LoadedModel, gemma3_dir: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="its vocabulary is not that of smollm2"):
        load_draft_model(gemma3_dir, target)
    hybrid = families.save("qwen3_next", tmp_path / "hybrid", smollm2_dir)
    with pytest.raises(ConfigError, match="recurrent state"):
        load_draft_model(hybrid, target)
