"""Forgetting an agent on the real SmolLM2 engine while the cache writer is stuck on the disk:
the engine thread only drops the caches from memory and queues their deletion; the wait for
the disk is the caller's, so other agents' turns go on meanwhile."""

from __future__ import annotations

import threading
from pathlib import Path

from app.types import ChatMessage, SamplingParams
from support.engines import cache_manager, conv, make_engine_at, turn

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def test_a_stalled_writer_does_not_hold_the_engine_thread_during_forget(tmp_path: Path, smollm2_dir: Path) -> None:
    engine = make_engine_at(tmp_path, smollm2_dir, ["gone", "stays"])
    try:
        turn(engine, "gone", [ChatMessage("user", "Name three colors.")], GREEDY)
        caches = cache_manager(engine)
        assert caches.flush(60) and caches.record(conv("gone")) is not None
        persister = caches._persister
        disk = threading.Event()  # the disk is stuck until set
        started = threading.Event()
        forget = persister._forget

        def stuck(conversation_id: str) -> None:
            started.set()
            disk.wait(60)
            forget(conversation_id)

        persister._forget = stuck  # type: ignore[method-assign]
        forgetting = threading.Thread(target=engine.forget_agent, args=("gone",))
        forgetting.start()
        assert started.wait(30)  # the writer is deleting the agent's cache, stuck

        other = threading.Thread(target=turn, args=(engine, "stays", [ChatMessage("user", "Name a fruit.")], GREEDY))
        other.start()
        other.join(30)
        assert not other.is_alive()  # another agent's turn ran on the engine thread meanwhile
        assert forgetting.is_alive()  # while the caller still waits for the disk
        assert caches.record(conv("gone")) is None and caches.record(conv("stays")) is not None
        disk.set()
        forgetting.join(60)
        assert not forgetting.is_alive() and caches.flush(60)
    finally:
        engine.stop()
