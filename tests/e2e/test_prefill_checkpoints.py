"""A process killed during a long prefill keeps what reached disk (issue 58): with
``prefill_checkpoint_s`` the prefill under way stores what it computed every few seconds, so
after a SIGKILL and a restart the same prompt resumes from the last checkpoint instead of
from zero. Real ``semantic serve`` on SmolLM2, a ~5,000-token prompt (a prefill of 15-40 s
here), real sockets."""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path

import httpx

from support.dbcheck import query
from support.servers import start_server, stop_server

LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 390  # ~5,000 tokens


def test_a_sigkill_during_a_long_prefill_keeps_the_blocks_that_reached_disk(smollm2_dir: Path,
                                                                            tmp_path: Path) -> None:
    session = f"killed-{uuid.uuid4().hex[:8]}"
    body = {"model": "m", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": LONG}]}
    server = start_server(tmp_path, smollm2_dir, {"SEMANTIC_PREFILL_CHECKPOINT_S": "2"})

    def send() -> None:
        try:
            httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-session-id": session}, timeout=300)
        except httpx.TransportError:
            pass  # the server is killed under it

    try:
        threading.Thread(target=send, daemon=True).start()
        deadline = time.monotonic() + 120
        on_disk = 0
        while on_disk < 1024 and time.monotonic() < deadline:  # a checkpoint of 4 blocks or more, on disk
            rows = query(server.db_path, "SELECT n_tokens FROM caches WHERE agent_id = ?", session) \
                if server.db_path.exists() else []
            on_disk = max((n for n, in rows), default=0)
            time.sleep(0.2)
        assert on_disk >= 1024, server.log()[-3000:]
        log = server.log()
        assert re.search(r"prefill checkpoint, \d+ of \d+ prompt tokens stored", log), log[-3000:]
        assert "prompt 5" not in log.split("prefill checkpoint")[-1]  # still prefilling: no turn ended
    finally:
        server.process.kill()
        server.process.wait()

    server = start_server(tmp_path, smollm2_dir)
    try:
        retry = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-session-id": session}, timeout=300)
        assert retry.status_code == 200
        usage = retry.json()["usage"]
        assert usage["cache_read_input_tokens"] >= on_disk // 256 * 256, (usage, on_disk)
        total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert usage["cache_read_input_tokens"] < total  # resumed part way, then prefilled the rest
        rows = query(server.db_path, "SELECT status, agent_id FROM requests ORDER BY created_at")
        assert rows == [("interrupted", session), ("ok", session)], rows  # the killed one says whose it was
    finally:
        stop_server(server)
