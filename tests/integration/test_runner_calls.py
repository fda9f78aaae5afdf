"""Work handed to the engine thread (``Runner.call``): a call the engine does not take in
time is a 503 (``EngineUnavailable``), never a hung request or a 500, and it never runs later."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from app.engine.admission import Admission
from app.engine.channel import Call
from app.engine.runner import Runner
from app.errors import EngineUnavailable


def _runner(load: Any) -> Runner:
    return Runner(load, lambda _loaded: None, default="m", max_queue=4, prefill_step_size=256,  # type: ignore[arg-type,return-value]
                  admission=Admission(budget_bytes=1 << 30))


def test_a_call_the_busy_engine_does_not_take_in_time_is_unavailable_and_cancelled() -> None:
    release = threading.Event()

    def load(_name: str) -> Any:  # the engine is busy loading a model
        release.wait(10)
        raise RuntimeError("no model here")

    runner = _runner(load)
    runner.start()
    ran: list[str] = []
    try:
        with pytest.raises(EngineUnavailable, match="did not take the call within 0.2 s"):
            runner.call(lambda _caches: ran.append("ran"), timeout_s=0.2)
    finally:
        release.set()
        runner.join(10)
    assert ran == []


def test_a_cancelled_call_is_skipped_and_a_live_one_runs() -> None:
    runner = _runner(lambda _name: None)
    runner._caches = object()  # type: ignore[assignment]
    runner._publish = lambda: None  # type: ignore[method-assign]  # (it reads the manager's state)
    ran: list[str] = []
    gave_up, live = Call(lambda _caches: ran.append("gave up")), Call(lambda _caches: ran.append("live") or 7)
    gave_up.result.cancel()
    for call in (gave_up, live):
        runner._calls.put(call)
    runner._run_calls()
    assert ran == ["live"] and live.result.result(0) == 7 and gave_up.result.cancelled()
