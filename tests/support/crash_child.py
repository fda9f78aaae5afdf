"""Turns on a real engine in its own process, the last optionally killed at a persistence step.

    python crash_child.py HOME MODEL_DIR TURNS_JSON [POINT:N]

Runs each turn of TURNS_JSON (a list of turns, each a list of messages; agent "crash",
one conversation) on the cache stored under HOME, waits until its cache is on disk and
prints its result as a JSON line. With ``POINT:N`` the process dies (``os._exit(70)``,
as a kill would: no cleanup, no flush) at the N-th call of a persistence step of the
last turn:

- ``save_file``: after a cache file's temporary copy is written, before its fsync;
- ``fsync``: after an fsync (odd calls: the temporary file; even: its directory);
- ``replace``: after a file is renamed into place, before its directory's fsync;
- ``save_cache``: before the index rows pointing to the new files are committed;
- ``unlink``: after that commit, before the previous record file is deleted.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

CRASH_EXIT = 70


def arm(point: str | None) -> Counter[str]:
    """Count calls of each step; die at ``point`` ("name:n")."""
    from app.cache import persist
    from app.cache import files as blockfiles

    calls: Counter[str] = Counter()
    target = (point.split(":")[0], int(point.split(":")[1])) if point else None

    def wrap(owner: Any, attr: str, name: str, after: bool) -> None:
        original: Callable[..., Any] = getattr(owner, attr)

        def step(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            hit = target == (name, calls[name])
            if hit and not after:
                os._exit(CRASH_EXIT)
            result = original(*args, **kwargs)
            if hit:
                os._exit(CRASH_EXIT)
            return result

        setattr(owner, attr, step)

    wrap(blockfiles, "save_file", "save_file", after=True)
    wrap(os, "fsync", "fsync", after=True)
    wrap(os, "replace", "replace", after=True)
    wrap(persist.cache_index, "save_cache", "save_cache", after=False)
    wrap(persist.Path, "unlink", "unlink", after=False)
    return calls


def main(home: Path, model_dir: Path, messages_path: Path, point: str | None) -> None:
    from app.engine.blas import load_fast_blas

    load_fast_blas("")
    from app.catalog.registry import Catalog
    from app.engine.engine import CacheConfig, Engine
    from engines import flush_caches  # tests/support/engines.py: this script's directory is on sys.path
    from app.store.db import make_engine, make_session_factory, upgrade
    from app.clock import utcnow
    from app.store.history import ensure_conversation, touch_agent
    from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams, TextDelta

    home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as session:
        touch_agent(session, "crash", "direct", utcnow())
        ensure_conversation(session, "crash-conv", "crash", "direct", utcnow())  # as the API does before a turn
    engine = Engine(Catalog.single("smollm2", model_dir), CacheConfig(home / "blocks", sessions, 1 << 30))
    engine.start()
    turns = json.loads(messages_path.read_text())
    for n, turn in enumerate(turns):
        messages = [ChatMessage(m["role"], m["content"]) for m in turn]
        calls = arm(point) if n == len(turns) - 1 else arm(None)
        job = engine.submit(GenerationRequest(f"crash-turn-{n}", engine.render(messages),
                                              SamplingParams(temperature=0.0, max_tokens=16), "crash", "crash-conv"))
        events = list(job.events())
        finished = events[-1]
        assert isinstance(finished, Finished)
        assert flush_caches(engine)
        print(json.dumps({"text": "".join(e.text for e in events if isinstance(e, TextDelta)),
                          "n_prompt": finished.n_prompt_tokens, "n_cached": finished.n_cached_tokens,
                          "n_output": finished.n_output_tokens,
                          "reuse": str(finished.reuse), "calls": dict(calls)}), flush=True)
    engine.stop()
    os._exit(0)  # everything is on disk; skip interpreter teardown (MLX's threads may abort in it)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
