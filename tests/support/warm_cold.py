"""A fixed set of conversations answered twice: from a reused cache (warm) and with
reuse off (a true cold prefill: the whole prompt tokenized at once, float KV).

Used by tests/integration/test_warm_equals_cold.py (exact with ``f32``) and by
benchmarks/warm_cold.py (how far each stored format moves the answers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from app.engine.engine import Engine
from app.types import ChatMessage, Finished, SamplingParams
from support.engines import turn

LONG_SYSTEM = ("You are a careful assistant for a small software company. Answer briefly, plainly and "
               "precisely; say so when you do not know. " * 24)


@dataclass(frozen=True, slots=True)
class Case:
    """One conversation: every user turn after the first is compared (its prompt holds
    the earlier turns and the warm replies); with ``edit`` (old, new), the last user
    message is then sent again with ``old`` replaced by ``new``, in the middle of a word,
    as a client that edits a message does."""

    name: str
    system: str
    users: tuple[str, ...]
    edit: tuple[str, str] | None = None


CASES = (
    Case("colors", LONG_SYSTEM, ("Name three primary colors.", "Now name three animals.",
                                 "Which of those animals is the largest?")),
    Case("code", "You are a Python expert. Reply with code only.",
         ("Write a function that reverses a string.", "Now make it return None for None.")),
    Case("math", "You are a math tutor.", ("What is 12 times 7?", "Add 16 to that. Show the steps.")),
    Case("story", LONG_SYSTEM, ("Tell me a two-sentence story about a cat.", "Give the cat a name and retell it.")),
    Case("capitals", "You answer geography questions.",
         ("What is the capital of France?", "And of Italy?", "Which of the two is further north?")),
    Case("basil", LONG_SYSTEM * 2, ("How do I keep basil alive indoors?", "What about in winter?")),
    Case("edit-word", LONG_SYSTEM, ("Please write the word internationalization and say how long it is.",),
         edit=("internationalization and say how long it is", "internationally famous and explain it")),
    Case("edit-name", "You are a friendly translator.", ("Translate 'bonjour' into English and Spanish.",),
         edit=("bonjour", "bonsoir")),
)


@dataclass(frozen=True, slots=True)
class Pair:
    """One compared turn: the warm answer and the cold one to the same prompt."""

    case: str
    turn: str  # "2", "3", or "edit"
    warm_tokens: tuple[int, ...]
    cold_tokens: tuple[int, ...]
    warm_text: str
    cold_text: str
    n_cached: int  # prompt tokens the warm turn reused
    n_prompt: int

    @property
    def identical(self) -> bool:
        return self.warm_tokens == self.cold_tokens

    @property
    def shared(self) -> float:
        """The fraction of the longer answer's text the two share before they diverge."""
        longest = max(len(self.warm_text), len(self.cold_text))
        return 1.0 if longest == 0 else len(os.path.commonprefix([self.warm_text, self.cold_text])) / longest


def agent_of(case: Case) -> str:
    return f"wc-{case.name}"


ColdAnswers = dict[tuple[ChatMessage, ...], tuple[str, Finished]]


def answer_pairs(warm: Engine, cold: Engine, case: Case, sampling: SamplingParams,
                 cold_answers: ColdAnswers | None = None) -> Iterator[Pair]:
    """Play ``case`` on ``warm`` (its agent's conversation: each turn reuses the last) and
    ask ``cold`` (reuse off) every compared prompt (once: ``cold_answers`` keeps them
    across runs with the same sampling)."""
    cold_answers = {} if cold_answers is None else cold_answers
    agent = agent_of(case)
    history = [ChatMessage("system", case.system)]
    for number, user in enumerate(case.users, 1):
        messages = [*history, ChatMessage("user", user)]
        reply, finished = turn(warm, agent, messages, sampling)
        if number > 1:
            yield _compare(cold, case, str(number), messages, reply, finished, sampling, cold_answers)
        history = [*messages, ChatMessage("assistant", reply)]
    if case.edit:
        old, new = case.edit
        assert old in case.users[-1]
        edited = [*history[:-2], ChatMessage("user", case.users[-1].replace(old, new, 1))]
        reply, finished = turn(warm, agent, edited, sampling)
        yield _compare(cold, case, "edit", edited, reply, finished, sampling, cold_answers)


def _compare(cold: Engine, case: Case, label: str, messages: list[ChatMessage], reply: str, warm: Finished,
             sampling: SamplingParams, cold_answers: ColdAnswers) -> Pair:
    key = tuple(messages)
    if key not in cold_answers:
        cold_answers[key] = turn(cold, None, messages, sampling)
    cold_reply, cold_finished = cold_answers[key]
    assert cold_finished.n_cached_tokens == 0 and cold_finished.n_prompt_tokens == warm.n_prompt_tokens
    return Pair(case.name, label, warm.output_token_ids, cold_finished.output_token_ids, reply, cold_reply,
                warm.n_cached_tokens, warm.n_prompt_tokens)
