"""Draft tokens from a smaller model that shares the served model's vocabulary (MLX).

The ``draft_model`` setting: a small model of the same family (Llama 3.2 1B for Llama
3.1 8B, Qwen3 0.6B for Qwen3 8B) guesses the next tokens greedily, and the served model
checks the guess in one forward pass as it checks a prompt-lookup draft
(``speculation.py``): the output is the one decoding without drafts gives, greedy token
for token, sampled by exact speculative sampling (a greedy draft is a point mass, so
``sampled_drafts.accept_sampled`` applies as it is). It drafts where the reply does not
copy the context; it costs the draft model's forward passes, one per draft token.

A ``ModelDraft`` stands in for ``drafting.PromptLookup`` in a sequence's lane: the same
history (``tokens``, ``extend``) and ``draft(k)``. It keeps the draft model's own cache of
the history (one ``KVCache`` per layer, cut back exactly), which trails the history: a
draft first cuts the tokens the served model rejected, feeds what the history gained since
(the whole prompt the first time, in chunks), then decodes ``k`` tokens. ``DraftModel``
keeps the drafters of recent conversations between turns (in memory, never stored), so a
warm turn feeds the draft model its new tokens only, as the served model's prefill does.

Its caches are counted in ``cache_memory_bytes``: those kept between turns within
``DRAFTS_SHARE`` of it (which the engine takes from the cache pool's budget), a running
generation's in its working bytes (``admission.Admission.draft_bytes_per_token``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as load_weights
from mlx_lm.utils import load_tokenizer

from app.cache.pool import RecentWithin
from app.engine.drafting import Drafter
from app.engine.model import LoadedModel, compute_dtype, kv_bytes_per_token, run_dtype
from app.engine.speculation import greedy_tokens
from app.errors import ConfigError

log = logging.getLogger(__name__)

CHUNK = 512  # the most history tokens one draft-model forward pass feeds
DRAFTS_SHARE = 1 / 8  # of cache_memory_bytes: the draft caches kept between turns


def draft_bytes_per_token(path: Path, dtype: str = "auto") -> int:
    """What the draft model at ``path`` holds for a token of a history it drafts after: its
    keys and values, at the dtype it runs in (``dtype``, else its weights')."""
    config = json.loads((path / "config.json").read_text())
    return kv_bytes_per_token(config, run_dtype(config, dtype).size)


def load_draft_model(path: Path, target: LoadedModel, dtype: str = "auto") -> nn.Module:
    """The draft model at ``path`` for ``target``.

    Raises:
        ConfigError: its vocabulary is not ``target``'s (its tokens would mean other text),
            or its layers keep state that cannot be cut back (recurrent layers).
    """
    tokenizer = load_tokenizer(path)
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError(f"draft_model {path}: its vocabulary is not that of {target.name} (a draft model must "
                          "share the served model's tokenizer, e.g. a smaller model of the same family)")
    model, config = load_weights(path)
    kinds = {type(layer).__name__ for layer in model.make_cache()} if hasattr(model, "make_cache") else set()
    if kinds - {"KVCache", "RotatingKVCache"}:
        raise ConfigError(f"draft_model {path} ({config.get('model_type')}): its layers keep recurrent state, "
                          "which a rejected draft cannot be cut back from; use an attention-only model")
    target_dtype = compute_dtype(dtype)
    if target_dtype is not None:
        model.set_dtype(target_dtype)
    mx.eval(model.parameters())
    log.info("draft model %s loaded for %s (%s, %d layers): it drafts instead of prompt lookup", path, target.name,
             config.get("model_type"), len(model.layers))
    return model


class DraftModel:
    """A draft model and the drafters of the conversations it drafted for last, kept in memory
    between turns while their caches fit ``budget_bytes``: a conversation's next turn takes its
    drafter up again and feeds the draft model only what the conversation gained (the reply's
    tail past the end and anything that differs are cut first)."""

    def __init__(self, model: nn.Module, budget_bytes: int) -> None:
        self.model = model
        self._kept: RecentWithin[ModelDraft] = RecentWithin(budget_bytes)

    @property
    def kept_bytes(self) -> int:
        """The bytes of the caches kept between turns (within ``budget_bytes``)."""
        return self._kept.nbytes

    def drafter(self, history: list[int], key: str | None) -> ModelDraft:
        """The drafter of a sequence whose history is ``history``: the one ``key`` released last, if kept."""
        kept = self._kept.take(key) if key is not None else None
        if kept is None:
            return ModelDraft(self.model, history)
        kept.restart(history)
        return kept

    def release(self, key: str | None, drafter: Drafter) -> None:
        """Keep ``drafter`` for ``key``'s next turn; the least recently released go while the
        kept caches exceed the budget (one larger than all of it is not kept)."""
        if key is None or not isinstance(drafter, ModelDraft) or drafter.nbytes > self._kept.budget_bytes:
            return
        self._kept.keep(key, drafter)


class ModelDraft:
    """One sequence's history and the draft model's cache of it."""

    def __init__(self, model: nn.Module, tokens: Iterable[int]) -> None:
        self._model = model
        self.tokens: list[int] = list(tokens)
        self._cache = [KVCache() for _ in model.layers]  # the window masks of sliding layers: the model's
        self._fed: list[int] = []  # the tokens in the cache: a prefix of the history, then drafted ones
        self._base = 0  # how many of them were fed from the history (so are still its prefix)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """The bytes of its cache's arrays (as allocated, a step beyond what they hold)."""
        return sum(layer.nbytes for layer in self._cache if layer.keys is not None)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the history."""
        self.tokens.extend(tokens)

    def restart(self, history: Iterable[int]) -> None:
        """A new history (a later turn of the conversation): the next draft keeps the cache's
        tokens that begin it and feeds the rest."""
        self.tokens = list(history)
        self._base = 0

    def draft(self, k: int) -> list[int]:
        """The draft model's greedy next ``k`` tokens after the history (none if ``k`` is 0)."""
        if k <= 0 or not self.tokens:
            return []
        kept = self._shared()
        if kept < len(self._fed):
            for layer in self._cache:
                layer.trim(len(self._fed) - kept)
            del self._fed[kept:]
        if kept == len(self.tokens):  # the history is all in the cache: feed its last token again
            for layer in self._cache:
                layer.trim(1)
            self._fed.pop()
        out: list[int] = []
        with mx.stream(generation_stream):
            rest = self.tokens[len(self._fed):]
            while len(rest) > CHUNK:
                self._feed(rest[:CHUNK])
                rest = rest[CHUNK:]
            token = self._feed(rest)
            self._base = len(self._fed)
            out.append(token)
            while len(out) < k:
                out.append(self._feed([token]))
                token = out[-1]
        return out

    def _feed(self, tokens: list[int]) -> int:
        """Feed ``tokens`` into the cache; the greedy token after them."""
        logits = self._model(mx.array([tokens]), cache=self._cache)[0, -1:]
        self._fed += tokens
        token: int = greedy_tokens(logits).item()  # type: ignore[assignment]  # one int
        return token

    def _shared(self) -> int:
        """How many leading tokens of the cache the history still has (drafts the served
        model rejected differ from it)."""
        n = min(len(self._fed), len(self.tokens))
        i = self._base
        while i < n and self._fed[i] == self.tokens[i]:
            i += 1
        return i
