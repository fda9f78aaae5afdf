"""A request that waits too long in the queue is refused with an honest retry-after
(issue 59: 24 long-context agents on a small budget all finished, the last after 1,257 s
in the queue with no 429). On the real SmolLM2: a turn of a conversation waits for that
conversation's running turn (they never run together); with ``max_queue_wait_s`` 1 and a
prefill of several seconds before it, it is refused with QueueTimeout, and the running
turn, and a later one, are served."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.catalog.registry import Catalog
from app.engine.engine import CacheConfig, Engine
from app.errors import QueueTimeout
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams

LONG = [ChatMessage("user", "Every crate in the warehouse carries a label, a weight and a date. " * 130)]
SHORT = [ChatMessage("user", "Say hi.")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def test_a_request_queued_past_its_bound_gets_429_with_retry_after(smollm2_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    cache = CacheConfig(tmp_path / "blocks", make_session_factory(make_engine(url)), 1 << 30, enabled=False)
    engine = Engine(Catalog.single("smollm2", smollm2_dir), cache, max_queue_wait_s=1)
    engine.start()
    try:
        running = engine.submit(GenerationRequest("req-running", engine.render(LONG), GREEDY, "a", "same"))
        queued = engine.submit(GenerationRequest("req-queued", engine.render(SHORT), GREEDY, "a", "same"))
        start = time.monotonic()
        with pytest.raises(QueueTimeout) as refused:
            list(queued.events())
        waited = time.monotonic() - start
        assert 1 <= waited < 5, waited  # refused once past its bound, not after the long prefill
        assert refused.value.retry_after_s >= 1
        assert "waited" in str(refused.value) and "max_queue_wait_s" in str(refused.value)
        assert isinstance(list(running.events())[-1], Finished)  # the running turn is served
        later = engine.submit(GenerationRequest("req-later", engine.render(SHORT), GREEDY, "a", "same"))
        assert isinstance(list(later.events())[-1], Finished)
    finally:
        engine.stop()
