"""Structured outputs: a grammar held over a sequence's tokens, as a logits processor (MLX).

A request's ``OutputConstraint`` (plain data: llguidance's grammar text) becomes an
``llguidance.LLMatcher`` over the model's tokenizer. Before each token is drawn, the
processor feeds the matcher the token drawn last and masks every token the grammar does
not allow next (its logit set to -inf); once the grammar is complete, only the model's
stop tokens are left, so the turn ends there. The batch applies it like any logits
processor (``batch.DecodeBatch``), after the repetition penalty; a sequence with one never
drafts (a draft would bypass the mask).

The matcher's tokenizer (llguidance's view of the model's: each token's bytes, the stop
tokens as its end of sequence) takes a fraction of a second to build, once per model and
process (``tokenizer_for``); a matcher for a JSON schema takes well under a millisecond.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from app.errors import InvalidRequest
from app.types import OutputConstraint

log = logging.getLogger(__name__)

_tokenizers: dict[str, llguidance.LLTokenizer] = {}
_lock = threading.Lock()


def tokenizer_for(spec: Any) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the model ``spec`` (an ``engine.model.ModelSpec``), built
    once per model fingerprint: its vocabulary as wide as the model's logits, its stop tokens
    as the end of sequence a complete grammar allows."""
    with _lock:
        cached = _tokenizers.get(spec.fingerprint)
        if cached is not None:
            return cached
        hf = getattr(spec.tokenizer, "_tokenizer", spec.tokenizer)
        n_vocab = max(spec.vocab_size, len(hf))
        eos = sorted(spec.stop_token_ids)
        try:
            built = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
        except ValueError:  # not a fast tokenizer object: its tokenizer.json says the same
            built = llguidance.LLTokenizer((spec.path / "tokenizer.json").read_text(), n_vocab=n_vocab, eos_token=eos)
        _tokenizers[spec.fingerprint] = built
        return built


def matcher_for(constraint: OutputConstraint, spec: Any) -> llguidance.LLMatcher:
    """A matcher for ``constraint`` on model ``spec``, fed the reply's start the prompt holds.

    Raises:
        InvalidRequest: the grammar does not compile for this tokenizer, or the reply's start
            (a prefill) is not what it allows.
    """
    tokenizer = tokenizer_for(spec)
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"{constraint.what}: {matcher.get_error()}", constraint.what)
    if constraint.prefix:
        tokens = tokenizer.tokenize_str(constraint.prefix)
        if not matcher.consume_tokens(tokens):
            raise InvalidRequest(f"{constraint.what}: the start of the reply the request gives "
                                 f"({constraint.prefix[-40:]!r}) is not what the format allows", constraint.what)
    return matcher


def check(constraint: OutputConstraint | None, spec: Any) -> None:
    """Raise InvalidRequest (from any thread, before the request is queued) if ``constraint``
    cannot hold on model ``spec`` (see ``matcher_for``)."""
    if constraint is not None:
        matcher_for(constraint, spec)


class GrammarMask:
    """The logits processor holding one sequence to its grammar.

    mlx-lm's batch calls it once per step with the sequence's tokens so far (the one fed this
    step last) and the step's logits ``(1, vocab)``: the first call's last token is the
    prompt's, every later call's the token drawn at the step before, which the matcher takes
    first. The mask comes from the matcher on the CPU (a bitmask, one bit per token).
    """

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: frozenset[int], request_id: str = "") -> None:
        self._matcher = matcher
        self._stop_ids = sorted(stop_ids)
        self._request_id = request_id
        self._fed = False  # the first call feeds nothing: its last token is the prompt's
        self.broken = False  # the matcher refused a token (never, unless a mask was bypassed)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._fed:
            token = int(tokens[-1].item())  # type: ignore[arg-type]  # an int array: .item() is an int
            if not self.broken and not self._matcher.consume_token(token):
                self.broken = True
                log.error("request %s: the grammar refused token %d (%s): the turn ends", self._request_id, token,
                          self._matcher.get_error())
        self._fed = True
        vocab = logits.shape[-1]
        if self.broken:
            allowed = np.zeros(vocab, dtype=bool)
            allowed[[t for t in self._stop_ids if t < vocab]] = True
        else:
            bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.zeros(vocab, dtype=bool)
            n = min(vocab, len(bits))
            allowed[:n] = bits[:n].astype(bool)
            if not allowed.any():  # a matcher in error (a resource limit) allows nothing: end the turn
                log.error("request %s: the grammar allows no token (%s): the turn ends", self._request_id,
                          self._matcher.get_error() or "no error given")
                self.broken = True
                allowed[[t for t in self._stop_ids if t < vocab]] = True
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))
