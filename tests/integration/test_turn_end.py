"""A turn ends when its reply does, not when its cache is quantized or reaches the disk
(issue 38): an agent's next step starts at the end of the reply. The cache is committed
right after, before the engine admits anything else, and written in the background; what a
kill before the write costs is a prefill (``test_crash_recovery.py``)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from app.cache.files import CacheFiles
from app.cache.manager import CacheManager
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams, TextDelta
from support.engines import conv, flush_caches, make_engine_at

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
MESSAGES = [ChatMessage("system", "You are a helpful assistant. " + "Answer briefly. " * 40),
            ChatMessage("user", "Name three colors.")]
STALL_S = 20.0  # far beyond any turn's end here: a reply that waited for the disk would show it


def timed_turn(engine, messages: list[ChatMessage]) -> tuple[float, Finished]:  # type: ignore[no-untyped-def]
    """One turn of agent "a": seconds from its last text to its end, and its ``Finished``."""
    job = engine.submit(GenerationRequest("req-a", engine.render(messages), GREEDY, "a", conv("a")))
    last_text = ended = finished = None
    for event in job.events():
        if isinstance(event, TextDelta):
            last_text = time.perf_counter()
        elif isinstance(event, Finished):
            ended, finished = time.perf_counter(), event
    assert last_text is not None and ended is not None and finished is not None
    return ended - last_text, finished


def stored_tokens(home: Path) -> list[int]:
    with sqlite3.connect(home / "semantic.db") as db:
        return [n for (n,) in db.execute("SELECT n_tokens FROM caches WHERE agent_id = 'a'")]


def test_a_reply_ends_before_its_cache_reaches_a_stalled_disk(tmp_path: Path, smollm2_dir: Path,
                                                               monkeypatch) -> None:  # type: ignore[no-untyped-def]
    disk = threading.Event()  # set: the disk moves again
    write_record = CacheFiles.write_record

    def stalled(self, cache):  # type: ignore[no-untyped-def]
        disk.wait(STALL_S)
        return write_record(self, cache)

    monkeypatch.setattr(CacheFiles, "write_record", stalled)
    engine = make_engine_at(tmp_path, smollm2_dir, ["a"], kv_format="f32")
    try:
        gap, finished = timed_turn(engine, MESSAGES)
        assert gap < 2.0, f"the reply ended {gap:.1f} s after its last text"
        assert stored_tokens(tmp_path) == []  # the write is still waiting for the disk

        disk.set()
        assert flush_caches(engine)
        assert stored_tokens(tmp_path) == [finished.n_prompt_tokens + finished.n_output_tokens]  # written once the disk moved
    finally:
        disk.set()
        engine.stop()


def test_a_reply_ends_before_its_cache_is_committed_and_the_next_turn_still_finds_it(
        tmp_path: Path, smollm2_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    commit = CacheManager.commit

    def slow(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(3.0)  # a long quantization
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(CacheManager, "commit", slow)
    engine = make_engine_at(tmp_path, smollm2_dir, ["a"], kv_format="f32")
    try:
        gap, first = timed_turn(engine, MESSAGES)
        assert gap < 2.0, f"the reply ended {gap:.1f} s after its last text"
        # Sent at once, while the commit runs: admitted after it, so it reads the whole first turn.
        _, second = timed_turn(engine, [*MESSAGES, ChatMessage("assistant", "Red, green, blue."),
                                        ChatMessage("user", "And three more?")])
        assert second.n_cached_tokens >= first.n_prompt_tokens
    finally:
        engine.stop()
