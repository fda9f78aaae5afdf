"""The Ollama API against a real server and the real model, over plain HTTP (the ``ollama``
client package is not installable here; httpx sends what it sends): two chat turns whose
second continues the first's cache, streamed and not; generate; the model endpoints."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from support.servers import ServerProcess
from support.dbcheck import query

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OPTIONS = {"temperature": 0, "num_predict": 16, "num_ctx": 8192}


def chat(server: ServerProcess, body: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    """The reply's text and the final object, streamed (NDJSON) or not."""
    body = {"model": "smollm2-135m-instruct", "options": OPTIONS, **body, "stream": stream}
    if not stream:
        answer = httpx.post(f"{server.url}/api/chat", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        return answer.json()["message"]["content"], answer.json()
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=300) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-ndjson"
        objects = [json.loads(line) for line in answer.iter_lines() if line]
    *chunks, last = objects
    assert all(c["done"] is False for c in chunks) and last["done"] is True
    return "".join(c["message"]["content"] for c in chunks), last


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_second_chat_turn_continues_the_first_ones_cache(server: ServerProcess, stream: bool) -> None:
    session = f"ol-{uuid.uuid4().hex[:8]}"
    first_text, first = chat(server, {"messages": QUESTION, "session_id": session}, stream)
    assert "Paris" in first_text and first["done_reason"] in ("stop", "length")
    for name in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                 "eval_duration"):
        assert isinstance(first[name], int) and first[name] >= 0, name
    assert first["total_duration"] > first["eval_duration"] > 0 and first["eval_count"] > 0
    history = [*QUESTION, {"role": "assistant", "content": first_text}, {"role": "user", "content": "And of Italy?"}]
    second_text, second = chat(server, {"messages": history, "session_id": session}, stream)
    assert second_text.strip()
    rows = query(server.db_path, "SELECT protocol, n_input_tokens, n_cached_tokens, reuse_reason FROM requests "
                                 "WHERE agent_id = ? ORDER BY created_at", session)
    assert [r[0] for r in rows] == ["ollama", "ollama"] and rows[1][3] == "extend", rows
    assert rows[1][2] >= rows[0][1] > 0  # the whole first prompt came from the cache
    # Ollama counts only the prompt tokens it computed: the new turn's, not the cached ones.
    assert second["prompt_eval_count"] == rows[1][1] - rows[1][2]
    assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(4,)]


def test_without_a_session_the_resent_history_is_recognised(server: ServerProcess) -> None:
    question = [{"role": "user", "content": f"Name a colour. ({uuid.uuid4().hex[:6]})"}]
    text, _ = chat(server, {"messages": question}, stream=False)
    history = [*question, {"role": "assistant", "content": text}, {"role": "user", "content": "Another one?"}]
    chat(server, {"messages": history}, stream=True)
    rows = query(server.db_path, "SELECT agent_id, n_cached_tokens FROM requests WHERE protocol = 'ollama' "
                                 "ORDER BY created_at DESC LIMIT 2")
    assert rows[0][0] == rows[1][0] and rows[0][1] > 0, rows


def test_generate_and_the_model_endpoints(server: ServerProcess) -> None:
    answer = httpx.post(f"{server.url}/api/generate", timeout=300, json={
        "model": "smollm2-135m-instruct", "prompt": "What is the capital of France?", "stream": False,
        "options": OPTIONS})
    assert answer.status_code == 200 and "Paris" in answer.json()["response"], answer.text
    refused = httpx.post(f"{server.url}/api/generate", json={"model": "smollm2-135m-instruct", "prompt": "x",
                                                              "context": [1, 2]})
    assert refused.status_code == 400 and refused.json()["error"].startswith("context:")
    tags = httpx.get(f"{server.url}/api/tags").json()["models"]
    assert "smollm2-135m-instruct" in [m["name"] for m in tags]
    show = httpx.post(f"{server.url}/api/show", json={"model": "smollm2-135m-instruct"}).json()
    assert show["model_info"]["general.architecture"] == "llama"
    assert show["model_info"]["llama.context_length"] == 8192
    assert [m["name"] for m in httpx.get(f"{server.url}/api/ps").json()["models"]] == ["smollm2-135m-instruct"]
    assert httpx.get(f"{server.url}/api/version").json()["version"]
