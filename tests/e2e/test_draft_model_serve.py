"""`semantic serve` with ``SEMANTIC_DRAFT_MODEL``: a real server drafts with a second model
and answers as it answers without drafts; a draft model of another vocabulary stops the
server at load with a line naming why (``tests/integration/test_draft_model.py`` checks
the drafting itself)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from support.servers import start_server, stop_server

COPY = ("Here is utils.py:\n```python\ndef add(a, b):\n    return a + b\n\n\ndef scale(values, factor):\n"
        "    return [v * factor for v in values]\n```\nRepeat the whole file exactly, but rename add to plus.")


def test_a_server_with_a_draft_model_drafts_and_answers_as_without(smollm2_dir: Path, tmp_path: Path) -> None:
    """It answers as without drafts, and the draft caches count in ``cache_memory_bytes``: the
    hot tier keeps 7/8 of it."""
    budget = 1 << 30
    server = start_server(tmp_path / "home", smollm2_dir, {"SEMANTIC_DRAFT_MODEL": str(smollm2_dir),
                                                           "SEMANTIC_CACHE_MEMORY_BYTES": str(budget)})
    try:
        replies = {}
        for session, speculate in (("plain", False), ("drafted", True)):
            body = {"model": "smollm2", "messages": [{"role": "user", "content": COPY}], "max_tokens": 40,
                    "temperature": 0, "speculate": speculate}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300,
                                  headers={"x-session-id": session})
            assert response.status_code == 200, response.text
            replies[session] = response.json()["choices"][0]["message"]["content"]
        assert replies["drafted"] == replies["plain"] and replies["plain"]
        log = server.log()
        assert f"draft model {smollm2_dir} loaded for" in log
        kept = re.findall(r"\(drafts (\d+)/(\d+) kept\)", log)
        assert len(kept) == 1 and int(kept[0][0]) > 0, kept  # only the drafted request drafted
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health["cache"]["pool_budget_bytes"] == budget - budget // 8  # the kept drafts' share
    finally:
        stop_server(server)


def test_a_draft_model_of_another_vocabulary_stops_the_server_naming_why(smollm2_dir: Path, gemma3_dir: Path,
                                                                          tmp_path: Path) -> None:
    try:
        server = start_server(tmp_path / "home", smollm2_dir, {"SEMANTIC_DRAFT_MODEL": str(gemma3_dir)})
    except RuntimeError as exc:  # it stopped before its health check answered
        log = str(exc)
    else:
        assert server.process.wait(timeout=120) != 0
        log = server.log()
    assert f"draft_model {gemma3_dir}: its vocabulary is not that of" in log
