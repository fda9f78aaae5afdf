"""Lossless speculative decoding of one sequence with prompt-lookup drafts (MLX).

A ``Lane`` is a sequence decoding on its own cache outside mlx-lm's
``GenerationBatch`` (``batch.DecodeBatch`` puts a sequence in one when it decodes
alone). Its state is the batch's: the cache holds every token handed out so far,
and ``pending``, the next token, is decided but not yet in the cache nor handed
out. A step feeds ``[pending, *draft]`` in one forward pass (the draft from
``drafting.PromptLookup``), takes the greedy token after each position, keeps
the draft's longest prefix that agrees with them, and trims the cache back over
the rest (``KVCache.trim``). It hands out ``pending`` and the accepted draft
tokens; the model's own token after them is the new ``pending``. Every token
handed out is therefore the one greedy decoding would have produced (up to
float32 rounding between a one-row and a several-row forward pass, as between
a prompt's prefill chunkings): drafts change the speed, never the text.

A lane that samples (its ``distribution``, ``sampled_drafts.token_distribution``)
verifies the draft by exact speculative sampling instead
(``sampled_drafts.accept_sampled``): each token handed out has the distribution plain
sampling would give it, and the token after the accepted draft is drawn from the
residual or, after a wholly accepted draft, from the model's distribution there.

Only sequences without logits processors speculate, and only on caches
that can be cut back exactly (plain ``KVCache`` per layer): a sliding-window
``RotatingKVCache`` or a recurrent ``ArraysCache`` (alone or in a ``CacheList``, as
Falcon-H1 keeps it beside its KV) loses state it cannot get back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from app.engine.drafting import DraftLength, PromptLookup
from app.engine.sampled_drafts import Distribution, accept_sampled


def can_trim_exactly(cache: Sequence[Any]) -> bool:
    """Whether every layer of ``cache`` is a plain ``KVCache`` (cut back to any length exactly)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def greedy_tokens(logits: mx.array) -> mx.array:
    """The greedy token of each row of ``logits`` ``(rows, vocab)``, computed as mlx-lm's
    ``GenerationBatch`` does (argmax of the normalized log-probabilities), so that a
    tie resolves the same way on either path."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


@dataclass
class Lane:
    """One sequence decoding on its own cache, drafting from its own history.

    ``lookup`` holds every token in ``cache`` and then ``pending``. ``silent``: how many
    of the next tokens fed are not handed out (a sequence that starts here feeds its
    last prompt token first, as ``GenerationBatch`` does when it joins). ``distribution``:
    what it samples from (None: greedy), with ``rng`` drawing the acceptances and tokens.
    """

    cache: list[Any]
    pending: int
    lookup: PromptLookup
    length: DraftLength
    silent: int = 0
    distribution: Distribution | None = None
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def step(self, model: nn.Module, before_forward: Any = None) -> list[int]:
        """Feed ``pending`` and a draft; returns the tokens handed out (now in the cache).

        ``before_forward(rows)``, if given, is called with the number of positions about to
        be fed (the engine picks its core split from it).
        """
        want = self.length.want()
        draft = self.lookup.draft(want) if want else []
        fed = [self.pending, *draft]
        if before_forward is not None:
            before_forward(len(fed))
        with mx.stream(generation_stream):
            n, after = self._verify(model(mx.array([fed]), cache=self.cache)[0], draft)
        if n < len(draft):
            for layer in self.cache:
                layer.trim(len(draft) - n)
        self.length.update(len(draft), n)
        self.pending = after
        self.lookup.extend([*draft[:n], self.pending])
        out = fed[:n + 1]
        if self.silent:
            dropped, self.silent = min(self.silent, len(out)), max(0, self.silent - len(out))
            out = out[dropped:]
        return out

    def _verify(self, logits: mx.array, draft: list[int]) -> tuple[int, int]:
        """(how many draft tokens hold, the token after them) from the logits ``(len(draft) + 1,
        vocab)`` at each position fed: greedily, or by exact speculative sampling."""
        if self.distribution is not None:
            return accept_sampled(np.array(self.distribution(logits.astype(mx.float32))), draft, self.rng)
        predicted: list[int] = greedy_tokens(logits).tolist()  # type: ignore[assignment]  # one row of ints
        n = 0
        while n < len(draft) and draft[n] == predicted[n]:
            n += 1
        return n, predicted[n]
