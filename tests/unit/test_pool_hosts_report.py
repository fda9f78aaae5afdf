"""benchmarks/pool_hosts.py: the report's aggregation (per turn, ownership, goals) from plain records."""

from __future__ import annotations

import pytest

from benchmarks.pool_hosts import cold_system, goals, ownership, summarise


def turn(server: str, ttft: float, cached: int, prompt: int, previous: int, retries: int = 0,
         served: bool = True) -> dict:
    return {"server": server if served else "", "served": served, "retries": retries,
            "ttft_s": ttft if served else None, "cached": cached, "prompt": prompt, "previous": previous}


TURNS = [
    [turn("h1", 2.0, 0, 100, 0), turn("h2", 0.4, 95, 120, 100, retries=2)],  # moved from h1 to h2
    [turn("h2", 3.0, 0, 200, 0), turn("h2", 0.2, 200, 220, 200)],
    [turn("h3", 2.5, 0, 150, 0), turn("", 0, 0, 0, 150, retries=10, served=False)],
]
COLD = [{"prompt": 150, "ttft_s": 2.5}, {"prompt": 180, "ttft_s": 3.0}]


def test_each_turn_counts_served_retries_cache_reads_of_the_previous_prompt_and_the_cold_speedup() -> None:
    first, second = summarise(TURNS, COLD)
    assert (first["agents"], first["served"], first["retries"]) == (3, 3, 0)
    assert first["cache_read"] is None and first["min_cache_read"] is None  # nothing before turn 1
    assert first["ttft_median_s"] == 2.5 and first["speedup"] == 1.0
    assert (second["served"], second["retries"], second["servers"]) == (2, 12, ["h2"])
    assert second["cache_read"] == (95 + 200) / (100 + 200)  # the failed turn counts nowhere
    assert second["min_cache_read"] == 0.95
    assert second["ttft_median_s"] == pytest.approx(0.3) and second["speedup"] == pytest.approx(10.0)


def test_an_owner_change_needs_a_later_epoch_and_the_last_server_as_owner() -> None:
    before = {"a": ("h1", 1), "b": ("h2", 1)}
    served_by = {"a": ["h1", "h2"], "b": ["h2", "h2"]}
    moved = ownership(before, {"a": ("h2", 2), "b": ("h2", 1)}, served_by)
    assert moved == {"changed": 1, "agents": ["a"], "moves": 1, "epochs_consistent": True}
    assert not ownership(before, {"a": ("h2", 1), "b": ("h2", 1)}, served_by)["epochs_consistent"]  # same epoch
    assert not ownership(before, {"a": ("h1", 2), "b": ("h2", 1)}, served_by)["epochs_consistent"]  # not its server


def test_the_goals_say_which_were_met() -> None:
    rows = summarise(TURNS, COLD)
    met = {goal: verdict["met"] for goal, verdict in goals(rows, TURNS, 1, True, True, 12.0).items()}
    assert met == {"turns served (>= 99%)": False,  # 5 of 6
                   "committed history in the store (100%)": True,
                   "previous prompt read from cache after the failure (>= 90%, least agent-turn)": True,
                   "first turn after the failure against a cold prefill (>= 5x)": True,
                   "no agent on two servers at once (epochs)": True,
                   "pool join serves its first agent (< 60 s)": True}
    late = goals(rows, TURNS, 1, False, False, None)
    assert not any(late[goal]["met"] for goal in ("committed history in the store (100%)",
                                                  "no agent on two servers at once (epochs)",
                                                  "pool join serves its first agent (< 60 s)"))


def test_each_cold_probe_starts_unlike_every_agent_and_every_other_probe() -> None:
    system = "You are agent 0, a shop assistant."
    probes = [cold_system(system, k) for k in range(6 * 3)]
    assert len(set(probes)) == len(probes)
    assert all(len(p) == len(system) and p[2:] == system[2:] and not p.startswith("Y") for p in probes)
