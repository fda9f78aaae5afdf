"""Shutdown with a stalled disk: the cache persister stops within its deadline and says what
it leaves unwritten, instead of holding the process (issue 35, item 15)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from app.cache import persist
from app.cache.files import CacheFiles
from app.cache.persist import Persister, Snapshot
from app.cache.records import CacheRecord, ConversationCache
from app.store.db import make_engine, make_session_factory, upgrade


def snapshot(conversation: str) -> Snapshot:
    record = CacheRecord((1, 2, 3), "abc", (1, 2, 3))
    return Snapshot(ConversationCache("agent", conversation, record, (), None), {})


def test_stop_with_a_stalled_disk_and_a_full_queue_returns_by_its_deadline(tmp_path: Path, monkeypatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    files = CacheFiles(tmp_path / "blocks", "f" * 64)
    disk = threading.Event()  # the disk is stuck until set
    monkeypatch.setattr(files, "write_record", lambda _cache: disk.wait(60))
    monkeypatch.setattr(persist, "MAX_QUEUED", 4)
    persister = Persister(files, make_session_factory(make_engine(url)))
    persister.start()
    try:
        persister.submit(snapshot("c0")).wait(0.2)  # taken by the thread: it hangs on the disk
        for i in range(1, 5):
            persister.submit(snapshot(f"c{i}"))  # the queue is full now
        stopped: list[bool] = []
        stopper = threading.Thread(target=lambda: stopped.append(persister.stop(timeout_s=1)), daemon=True)
        with caplog.at_level(logging.WARNING, logger="app.cache.persist"):
            stopper.start()
            stopper.join(10)
        assert not stopper.is_alive(), "stop() hung on the stalled disk"
        assert stopped == [False]
        assert "5 cache write(s) not done after 1 s" in caplog.text
    finally:
        disk.set()


def test_flush_waits_its_timeout_in_all_not_once_for_the_disk_and_again_for_the_tier(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """``flush(t)`` gives the shared tier's uploads what is left of ``t`` after the disk writes
    (before: ``t`` again, so a server's shutdown could take 30 s more than its budget)."""
    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    files = CacheFiles(tmp_path / "blocks", "f" * 64)
    monkeypatch.setattr(files, "write_record", lambda _cache: time.sleep(1.5))  # a slow disk
    given: list[float | None] = []

    class StuckTier:  # the uploads never finish
        def flush(self, timeout_s: float | None = None) -> bool:
            given.append(timeout_s)
            return False

    persister = Persister(files, make_session_factory(make_engine(url)))
    persister._uploader = StuckTier()  # type: ignore[assignment]
    persister.start()
    persister.submit(snapshot("c0"))
    assert persister.flush(2.0) is False
    assert given and given[0] is not None and given[0] < 0.6, given


def test_a_pool_waits_out_a_servers_whole_shutdown_before_killing_it() -> None:
    """``pool drain`` / ``down`` SIGKILL a server only after its own shutdown budget (the
    requests it runs, then the cache writes: flush, then stop); before, 30 s killed a server
    still flushing to a slow tier, its agents unreleased."""
    from app.pool.supervisor import STOP_TIMEOUT_S

    assert STOP_TIMEOUT_S >= persist.FLUSH_ON_CLOSE_S + persist.STOP_ON_CLOSE_S + 15


def test_a_failed_write_is_logged_without_the_prompts_text(tmp_path: Path, monkeypatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Issue 59, item 3: a full disk logged each failed snapshot whole at ERROR, prompt text included."""
    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    files = CacheFiles(tmp_path / "blocks", "f" * 64)

    def full_disk(_cache: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_record", full_disk)
    persister = Persister(files, make_session_factory(make_engine(url)))
    persister.start()
    secret = "the user's private prompt text"
    record = CacheRecord(tuple(range(len(secret))), secret, tuple(range(1, len(secret) + 1)))
    try:
        with caplog.at_level(logging.DEBUG, logger="app.cache.persist"):
            persister.submit(Snapshot(ConversationCache("agent", "conv_1", record, (), None), {})).wait(10)
        assert "persisting a cache failed (cache of conversation conv_1, 30 tokens, 0 blocks)" in caplog.text
        assert secret not in caplog.text and "No space left on device" in caplog.text
    finally:
        persister.stop(timeout_s=5)
