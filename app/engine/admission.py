"""Which generations may run together: the admission rule, on plain values. Pure.

Each running generation fills a float working cache as long as its prompt and output
(``working_bytes``), and with a draft model that model's cache of the same tokens. The
working caches of the running ones stay within the memory budget, but one always runs:
a request that would exceed the budget alone is refused when it is submitted
(``refusal``), and one waits in the queue while it would not fit beside the running ones
(``can_start``). Two turns of one conversation never run together: the later waits for
the earlier's commit, so it reuses what that turn stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.types import GenerationRequest


class ModelSize(Protocol):
    """What admission needs of a model (``engine.model.ModelSpec`` has it)."""

    @property
    def context_length(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...


def working_bytes(request: GenerationRequest, model: ModelSize, draft_bytes_per_token: int = 0) -> int:
    """The float working cache a request fills at most: its prompt and its output (with a
    draft model, whose cache of them costs ``draft_bytes_per_token`` a token, both caches)."""
    n_tokens = min(request.prompt.n_tokens + request.sampling.max_tokens, model.context_length)
    return n_tokens * (model.kv_bytes_per_token + draft_bytes_per_token)


@dataclass(frozen=True, slots=True)
class Admission:
    budget_bytes: int  # the working caches of the running generations stay within it
    max_batch: int = 8  # generations running at once
    draft_bytes_per_token: int = 0  # a draft model's cache of a token, beside each generation's own

    def _working(self, request: GenerationRequest, model: ModelSize) -> int:
        return working_bytes(request, model, self.draft_bytes_per_token)

    def _fits(self, request: GenerationRequest, model: ModelSize, used_bytes: int) -> bool:
        return used_bytes + self._working(request, model) <= self.budget_bytes

    def refusal(self, request: GenerationRequest, model: ModelSize) -> str | None:
        """Why ``request`` can never run (its working cache alone exceeds the budget), or None."""
        if self._fits(request, model, 0):
            return None
        need = self._working(request, model)
        return (f"this request needs {need / 2**20:.0f} MiB of working memory for its KV cache; "
                f"the memory budget (cache_memory_bytes) is {self.budget_bytes / 2**20:.0f} MiB")

    def can_start(self, request: GenerationRequest, running: Sequence[GenerationRequest], model: ModelSize) -> bool:
        """Whether ``request`` may join the ``running`` ones now."""
        if len(running) >= self.max_batch:
            return False
        conversation = request.conversation_id
        if conversation is not None and any(r.conversation_id == conversation for r in running):
            return False
        return not running or self._fits(request, model, sum(self._working(r, model) for r in running))
