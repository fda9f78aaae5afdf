"""The agents of a simulated run: when each arrives, its system prompt, and its turns.

Drawn once from the seed, before any routing, so every policy serves exactly the same
agents (common random numbers). An agent's conversation grows turn by turn: its turn k
prompt is the system prompt and every earlier message and reply, then the new user
message; a cache can save all of it but that new message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    agents: int = 100_000
    arrival_s: float = 7200.0  # agents arrive uniformly at random over this window
    turns: tuple[int, int] = (4, 14)  # per agent, inclusive
    user_tokens_median: float = 200.0  # lognormal new tokens per turn (tool output, a question)
    user_tokens_sigma: float = 0.8
    reply_tokens: tuple[int, int] = (16, 160)
    think_s: float = 30.0  # mean pause between a reply and the next turn (exponential)
    system_prompts: int = 20  # shared by the agents, Zipf-popular
    system_tokens: tuple[int, int] = (1024, 3072)
    max_context: int = 8192  # SmolLM2's: a conversation ends before it would pass this


@dataclass(frozen=True)
class Plan:
    """Flat lists (fast to index in the event loop): agent a's turns are
    ``first[a]:first[a + 1]`` of ``user``, ``reply`` and ``think``."""

    arrival: list[float]
    system: list[int]  # the agent's system prompt
    system_tokens: list[int]  # per system prompt
    first: list[int]
    user: list[int]
    reply: list[int]
    think: list[float]

    @property
    def n_turns(self) -> int:
        return len(self.user)


def make_plan(workload: Workload, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    n, most = workload.agents, workload.turns[1]
    arrival = np.sort(rng.uniform(0, workload.arrival_s, n))
    system_tokens = rng.integers(workload.system_tokens[0], workload.system_tokens[1] + 1, workload.system_prompts)
    popularity = 1.0 / np.arange(1, workload.system_prompts + 1) ** 1.1
    system = rng.choice(workload.system_prompts, size=n, p=popularity / popularity.sum())
    drawn = rng.integers(workload.turns[0], most + 1, n)
    user = np.clip(rng.lognormal(np.log(workload.user_tokens_median), workload.user_tokens_sigma, (n, most)),
                   16, 4000).astype(np.int64)
    reply = rng.integers(workload.reply_tokens[0], workload.reply_tokens[1] + 1, (n, most))
    think = rng.exponential(workload.think_s, (n, most))
    # Turn k fits if the conversation after its reply stays within max_context.
    after = system_tokens[system][:, None] + np.cumsum(user + reply, axis=1)
    fits = (after <= workload.max_context).sum(axis=1)
    n_turns = np.maximum(1, np.minimum(drawn, fits))
    keep = np.arange(most)[None, :] < n_turns[:, None]
    first = np.concatenate(([0], np.cumsum(n_turns)))
    return Plan(arrival=arrival.tolist(), system=system.tolist(), system_tokens=system_tokens.tolist(),
                first=first.tolist(), user=user[keep].tolist(), reply=reply[keep].tolist(), think=think[keep].tolist())
