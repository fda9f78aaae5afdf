"""A process killed at each step of persisting a turn's cache (file writes, fsyncs,
renames, the index commit, the old record's deletion): after a restart the store
verifies, and the next turn gets exactly the answer of one of the two states the crash
may leave (the newest turn's cache kept, or lost), never a third."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.crash_child import CRASH_EXIT
from support.store_check import store_problems

CHILD = Path(__file__).parents[1] / "support" / "crash_child.py"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " + "Answer briefly and precisely. " * 60}
TURN1 = [SYSTEM, {"role": "user", "content": "Name three primary colors."}]
# (step, call) killed at; "last" is the turn's last call of that step (its last block file).
POINTS = ["save_file:1", "fsync:2", "replace:1", "replace:last", "save_cache:1", "unlink:1"]
AFTER_COMMIT = {"unlink:1"}


def run_turns(home: Path, model_dir: Path, *turns: list[dict[str, str]], point: str | None = None,
              ) -> subprocess.CompletedProcess[str]:
    """The turns one after another in one new process (a restart before the first), the
    last killed at ``point``."""
    path = home.parent / f"{home.name}-messages.json"
    path.write_text(json.dumps(turns))
    command = [sys.executable, str(CHILD), str(home), str(model_dir), str(path), *([point] if point else [])]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})


def results(done: subprocess.CompletedProcess[str], exit_code: int = 0) -> list[dict[str, Any]]:
    """Each turn's result, in order (a crashed process's: the turns before the last)."""
    assert done.returncode == exit_code, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]


def result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return results(done)[-1]


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Any]:
    """Turn 1 and the reference turn 2 in one process, then turn 3 after a restart (``kept``);
    turn 1, then turn 3 after a restart (``lost``). Every home is built by its own turns:
    the index stores absolute paths, so no copies."""
    root = tmp_path_factory.mktemp("crash")
    first = result(run_turns(root / "lost", smollm2_dir, TURN1))
    turn2 = [*TURN1, {"role": "assistant", "content": first["text"]},
             {"role": "user", "content": "Now name three animals, and say one thing about each of them. "
                                         + "Keep it short and plain. " * 40}]  # turn 2 completes a new block
    again, second = results(run_turns(root / "kept", smollm2_dir, TURN1, turn2))
    assert again["text"] == first["text"]
    turn3 = [*turn2, {"role": "assistant", "content": second["text"]}, {"role": "user", "content": "Thanks!"}]
    return {"root": root, "first": first, "second": second, "turn2": turn2, "turn3": turn3,
            "kept": result(run_turns(root / "kept", smollm2_dir, turn3)),
            "lost": result(run_turns(root / "lost", smollm2_dir, turn3))}


def test_the_reference_turns_reuse_and_write_what_the_crash_points_need(states: dict[str, Any]) -> None:
    first, second = states["first"], states["second"]
    assert second["n_cached"] >= first["n_prompt"]  # turn 2 extended turn 1
    assert second["calls"]["replace"] >= 2  # a new block and the record: "replace:1" is not the last
    assert second["calls"]["unlink"] >= 1  # turn 1's record is replaced
    assert states["kept"]["n_cached"] > states["lost"]["n_cached"] >= second["n_cached"]


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_persistence_step_leaves_a_consistent_store(states: dict[str, Any], smollm2_dir: Path,
                                                                      point: str) -> None:
    home = states["root"] / f"crash-{point.replace(':', '-')}"
    point = point.replace("last", str(states["second"]["calls"][point.split(":")[0]]))
    crashed = run_turns(home, smollm2_dir, TURN1, states["turn2"], point=point)  # turn 1, then turn 2 killed
    assert [r["text"] for r in results(crashed, CRASH_EXIT)] == [states["first"]["text"]], f"no crash at {point}"
    assert store_problems(home) == []
    after = result(run_turns(home, smollm2_dir, states["turn3"]))
    expected = states["kept"] if point in AFTER_COMMIT else states["lost"]
    assert (after["n_cached"], after["text"]) == (expected["n_cached"], expected["text"])
    assert store_problems(home) == []
