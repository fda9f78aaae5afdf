"""The shared tier goes down under a real server (SeaweedFS, a real S3 server, killed and
started again on its directory): turns go on warm from the local cache with their
history, and when the tier returns the write-through catches up: the conversation's
newest record and every block it lists, those first written during the outage
included, are in the bucket and verify."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import pytest

from app.cache.shared_tier import S3Tier
from app.cache import files as blockfiles
from support.servers import free_ports, start_server, stop_server
from support.dbcheck import query

SYSTEM = "You answer garden centre questions in one short sentence. " * 25
AGENT = "gardener"


def turn(url: str, history: list[dict]) -> dict:
    response = httpx.post(f"{url}/v1/messages", timeout=120, headers={"x-claude-code-session-id": AGENT}, json={
        "model": "smollm2", "max_tokens": 8, "temperature": 0, "system": SYSTEM, "messages": history})
    assert response.status_code == 200, response.text
    body = response.json()
    history.append({"role": "assistant", "content": body["content"][0]["text"]})
    return body["usage"]


def ask(history: list[dict], n: int) -> None:
    # Long questions: each turn fills a new 256-token block or most of one.
    history.append({"role": "user", "content": f"Question {n}: " + "which roses, tulips and herbs grow well "
                                                                   "in shade, and when to plant them? " * 12})


def newest_cache(db: Path) -> tuple[str, int, list[str]]:
    rows = query(db, "SELECT record_path, n_tokens, id FROM caches WHERE agent_id = ? "
                     "ORDER BY updated_at DESC LIMIT 1", AGENT)
    if not rows:  # a reply ends before its cache is written (the caller waits for it)
        return "", 0, []
    (record, n_tokens, cache_id), = rows
    blocks = [p for p, in query(db, "SELECT b.path FROM cache_blocks c JOIN blocks b ON b.hash = c.block_hash "
                                    "WHERE c.cache_id = ? ORDER BY c.position", cache_id)]
    return record, n_tokens, blocks


def key(path: str) -> str:
    """A local cache file's object key: its path below ``blocks/``."""
    parts = Path(path).parts
    return "/".join(parts[parts.index("blocks") + 1:])


def in_tier(tier: S3Tier, path: str) -> bool:
    """Whether the tier holds the file, whole (it verifies)."""
    copy = Path(tempfile.mkdtemp()) / Path(path).name
    try:
        if not tier.fetch(key(path), copy):
            return False
        blockfiles.read(copy)
        return True
    except Exception:
        return False


def wait_in_tier(tier: S3Tier, db: Path, n_tokens: int, timeout_s: float = 60) -> list[str]:
    """Until the agent's newest cache (at least ``n_tokens``) is in the tier, record and blocks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record, stored, blocks = newest_cache(db)
        if stored >= n_tokens and in_tier(tier, record) and all(in_tier(tier, b) for b in blocks):
            return blocks
        time.sleep(0.3)
    raise AssertionError(f"the cache of {AGENT} ({n_tokens} tokens) did not reach the tier whole")


def test_turns_go_on_while_the_tier_is_down_and_the_write_through_catches_up(
        tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.pool.seaweed import LocalS3, stop

    s3 = LocalS3(tmp_path / "s3", free_ports(LocalS3.N_PORTS))
    for name, value in s3.credentials.items():
        monkeypatch.setenv(name, value)
    weed = s3.start(tmp_path / "s3.log")
    tier = S3Tier(s3.block_store)
    server = None
    try:
        tier.ensure_bucket()
        server = start_server(tmp_path / "home", smollm2_dir, {
            "SEMANTIC_BLOCK_STORE": s3.block_store, "SEMANTIC_SERVER_ID": "solo", **s3.credentials})
        history: list[dict] = []
        ask(history, 1)
        usage = turn(server.url, history)
        first_blocks = wait_in_tier(tier, server.db_path, usage["input_tokens"] + usage["cache_read_input_tokens"] - 1)

        stop(weed)
        for n in (2, 3):  # the tier is down: warm from the local cache all the same
            before = newest_cache(server.db_path)[1]
            ask(history, n)
            usage = turn(server.url, history)
            assert usage["cache_read_input_tokens"] >= before - 1
        time.sleep(1)  # the uploader has tried, and failed
        assert "shared tier: upload of" in server.log()
        assert not in_tier(tier, newest_cache(server.db_path)[0])

        weed = s3.start(tmp_path / "s3.log")  # back, with what it held before
        before = newest_cache(server.db_path)[1]
        ask(history, 4)
        usage = turn(server.url, history)
        assert usage["cache_read_input_tokens"] >= before - 1
        blocks = wait_in_tier(tier, server.db_path, usage["input_tokens"] + usage["cache_read_input_tokens"] - 1)
        assert len(blocks) > len(first_blocks) + 1  # blocks first written during the outage are there too
        assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", AGENT) == [(8,)]
    finally:
        if server is not None:
            stop_server(server)
        stop(weed)
