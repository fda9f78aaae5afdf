"""One generation in flight on the engine thread: how it starts from its cache lease, its
prompt still to prefill, its output so far, when it ends and how, and the record of what its
cache then holds. Holds no MLX arrays of its own but its working cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.cache import checkpoints
from app.cache.manager import Lease
from app.cache.records import CacheRecord
from app.engine.channel import Failed, Job
from app.engine.grammar import GrammarMask, matcher_for
from app.engine.model import ModelSpec
from app.engine.sampled_drafts import Distribution, token_distribution
from app.engine.sampling import sampler_for
from app.engine.stopping import EndMatcher, StopMatcher
from app.engine.timing import TurnClock
from app.engine.token_text import TextTracker, TokenBytes, spells
from app.types import Finished, GenerationEvent, StopReason, TextDelta, TokenLogprob


@dataclass
class Sequence:
    job: Job
    lease: Lease
    prompt_ids: tuple[int, ...]  # the prompt tokens this turn computes (after the reused ones)
    prompt_ends: tuple[int, ...]
    storable: bool  # the record may be stored (the tokens spell the prompt exactly)
    max_new: int
    sampler: Callable[..., Any]
    token_bytes: TokenBytes
    stop_ids: frozenset[int]
    clock: TurnClock
    n_prefilled: int = 0
    seconds_per_token: float | None = None  # the speed of its last prefill chunk
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    reason: StopReason = "max_tokens"
    stop_sequence: str | None = None
    n_drafted: int = 0  # speculative draft tokens proposed, and accepted (set as it ends)
    n_accepted: int = 0
    distribution: Distribution | None = None  # what ``sampler`` draws from (None: greedy)
    grammar: GrammarMask | None = None  # its structured output's logits processor
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each output token's, when asked
    checkpointed_at: float | None = None  # when its prefill last stored what it computed (perf_counter)
    n_checkpointed: int = 0  # the prompt tokens that stored, of ``prompt_ids``

    @classmethod
    def begin(cls, job: Job, lease: Lease, model: ModelSpec, clock: TurnClock) -> Sequence:
        """The generation of ``job`` on ``model``, after the ``lease``'s reused tokens;
        ``clock``: when its request arrived, was taken from the queue and got its lease.

        The lease holds the prompt's first tokens exactly as the prompt's own tokenization
        has them (``cache.matcher``), so the rest are the prompt's own tokens too: warm
        computes the token sequence a cold prefill computes (Invariants 2 and 3).
        """
        prompt, sampling = job.request.prompt, job.request.sampling
        n = lease.n_reused
        assert lease.record.tokens == prompt.token_ids[:n], "a lease reuses the prompt's own tokens"
        start = prompt.ends[n - 1] if n else 0
        ids, ends = prompt.token_ids[n:], tuple(end - start for end in prompt.ends[n:])
        storable = bool(prompt.ends) and spells(model.token_bytes, prompt.token_ids, prompt.text)
        max_new = min(sampling.max_tokens, model.context_length - n - len(ids))
        if lease.plan is not None:  # a hybrid model: checkpoints where its prefill stops (the last token decodes)
            lease.plan.positions = checkpoints.plan(n, n + len(ids) - (1 if max_new > 0 else 0))
        top_k = sampling.top_k if sampling.top_k < model.vocab_size else 0
        grammar = None
        if sampling.constraint is not None and max_new > 0:
            grammar = GrammarMask(matcher_for(sampling.constraint, model), model.stop_token_ids,
                                  job.request.request_id)
        return cls(job, lease, tuple(ids), tuple(ends), storable, max_new=max_new,
                   sampler=sampler_for(sampling.temperature, sampling.top_p, top_k, sampling.seed),
                   distribution=token_distribution(sampling.temperature, sampling.top_p, top_k),
                   token_bytes=model.token_bytes, stop_ids=model.stop_token_ids, clock=clock, grammar=grammar)

    def __post_init__(self) -> None:
        self.tracker = TextTracker(self.token_bytes)
        self.stops = StopMatcher(self.job.request.sampling.stop_sequences)
        self.ends = EndMatcher(self.job.request.sampling.end_after)
        self._unsent: list[TokenLogprob] = []  # log-probabilities not sent with a delta yet

    @property
    def processors(self) -> tuple[Any, ...]:
        """Its own logits processors (after the server's): its grammar's mask, if any."""
        return (self.grammar,) if self.grammar is not None else ()

    @property
    def cache(self) -> list[Any]:
        return self.lease.cache

    @property
    def n_prompt(self) -> int:
        return self.lease.n_reused + len(self.prompt_ids)

    def clip_chunk(self, n: int) -> int:
        """How many tokens a prefill chunk of at most ``n`` takes: a hybrid model's ends where
        a checkpoint is due."""
        plan = self.lease.plan
        return plan.chunk(self.lease.n_reused + self.n_prefilled, n) if plan is not None else n

    def after_prefill(self) -> None:
        """After a prefill chunk: a hybrid model takes the checkpoint due there, if any."""
        if self.lease.plan is not None:
            self.lease.plan.after_prefill(self.cache, self.lease.n_reused + self.n_prefilled)

    @property
    def n_written(self) -> int:
        """Prompt tokens this turn adds to the conversation's cache."""
        return len(self.prompt_ids) if self.committable else 0

    @property
    def n_pending(self) -> int:
        """Prompt tokens still to prefill before decoding starts (the last one starts it;
        a prefill-only turn computes them all)."""
        return len(self.prompt_ids) - self.n_prefilled - (1 if self.max_new > 0 else 0)

    @property
    def context_tokens(self) -> list[int]:
        """Every token in the cache once prefill is done (repetition penalty context)."""
        return [*self.lease.record.tokens, *self.prompt_ids[:-1]]

    def put(self, event: GenerationEvent | Failed) -> None:
        self.job.put(event)

    def _send(self, text: str) -> None:
        """Send ``text`` (and the log-probabilities of the tokens since the last delta)."""
        if text or self._unsent:
            self.put(TextDelta(text, tuple(self._unsent)))
            self._unsent.clear()

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Take one generated token (already in the cache) and, when the request asked, its
        log-probabilities; True when the turn is over."""
        if not self.output:
            self.first_token_at = time.perf_counter()
        self.output.append(token)
        text = self.tracker.add(token)
        if self.job.cancelled:
            self.reason = "cancelled"
            return True
        if token in self.stop_ids:
            self.reason = "end_turn"
            return True
        if logprob is not None:
            self.logprobs.append(logprob)
            self._unsent.append(logprob)
        check = self.stops.feed(text)
        self._send(check.emit)
        if check.stop_sequence is not None:
            self.reason, self.stop_sequence = "stop_sequence", check.stop_sequence
            return True
        if self.ends.feed(text):
            self.reason = "end_turn"
            return True
        return len(self.output) >= self.max_new

    def flush_text(self) -> None:
        """Send what is held back (a stop sequence's possible start), as the turn ends."""
        tail = self.tracker.finish()
        if self.reason == "max_tokens":
            check = self.stops.feed(tail)
            if check.stop_sequence is not None:
                self.reason, self.stop_sequence = "stop_sequence", check.stop_sequence
            rest = check.emit if check.stop_sequence else check.emit + self.stops.flush()
            self._send(rest)
        elif self.reason == "end_turn" and (held := self.stops.flush()):
            self._send(held)
        self._send("")

    @property
    def committable(self) -> bool:
        """Its cache may be stored as its conversation's (the tokens spell the prompt, and
        there is a conversation)."""
        return self.storable and self.lease.conversation_id is not None

    def record(self) -> CacheRecord:
        """What its cache holds once it has ended: the reused prefix, its prompt, its output."""
        lease = self.lease
        unreused = self.job.request.prompt.text[lease.record.ends[-1] if lease.n_reused else 0:]
        return lease.record.extend(self.prompt_ids, unreused, self.prompt_ends) \
            .extend(self.output, self.tracker.text, self.tracker.ends)

    def prefilled_record(self) -> CacheRecord | None:
        """What its cache holds when its prefill stopped part way (cancelled): the reused prefix
        and the prompt tokens computed so far; None if it computed none, or they do not spell
        the prompt's text exactly up to their end (then nothing is stored)."""
        n = self.n_prefilled
        if not n or not self.committable:
            return None
        lease = self.lease
        unreused = self.job.request.prompt.text[lease.record.ends[-1] if lease.n_reused else 0:]
        tokens, text = self.prompt_ids[:n], unreused[:self.prompt_ends[n - 1]]
        if not spells(self.token_bytes, tokens, text):
            return None
        return lease.record.extend(tokens, text, self.prompt_ends[:n])

    def finished(self, committed: bool) -> Finished:
        """The turn's last event; ``committed``: its cache was stored. Its times count from
        the request's arrival (``TurnClock``)."""
        now = time.perf_counter()
        parts = self.clock.split(self.first_token_at if self.first_token_at is not None else now)
        return Finished(
            stop_reason=self.reason, stop_sequence=self.stop_sequence, n_prompt_tokens=self.n_prompt,
            n_cached_tokens=self.lease.n_reused, n_cache_written=self.n_written if committed else 0,
            n_output_tokens=len(self.output), ttft_s=parts.ttft_s if self.first_token_at is not None else 0.0,
            total_s=self.clock.since_arrival(now), output_token_ids=tuple(self.output), reuse=self.lease.report,
            queue_s=parts.queue_s, restore_s=parts.restore_s, prefill_s=parts.prefill_s,
            n_draft_tokens=self.n_drafted, n_draft_accepted=self.n_accepted, logprobs=tuple(self.logprobs))
