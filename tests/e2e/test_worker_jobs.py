"""The worker's jobs on caches a real server wrote: expire, compact, evict, then a restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai

from conftest import ROOT
from support.servers import start_server, stop_server
from support.dbcheck import query, wait_persisted

SYSTEM = {"role": "system", "content": "You are a helpful assistant for a travel agency. " * 50}  # > 2 blocks


def run_job(home: Path, name: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "app", "jobs", "run", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "SEMANTIC_HOME": str(home), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_files(home: Path) -> list[Path]:
    return [p for p in (home / "blocks").rglob("*.safetensors") if "quarantine" not in p.parts]


def test_expire_compact_evict_and_restart(tmp_path: Path, smollm2_dir: Path) -> None:
    home = tmp_path / "home"
    server = start_server(home, smollm2_dir)
    db = home / "semantic.db"
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        for session, ttl in (("keep", 3600), ("short", 1), ("plain", None)):
            extra = {"session_id": session, **({"ttl": ttl} if ttl is not None else {})}
            client.chat.completions.create(model="m", max_tokens=4, temperature=0, extra_body=extra, messages=[
                SYSTEM, {"role": "user", "content": f"Plan a trip for {session}."}])
        for session in ("keep", "short", "plain"):
            wait_persisted(db, session, 512)
        n_messages = query(db, "SELECT count(*) FROM messages")
        time.sleep(1.5)

        expired = run_job(home, "expire")
        assert expired["conversations"] == [c for (c,) in query(
            db, "SELECT conversation_id FROM caches WHERE agent_id = 'short'")]
        assert expired["expired"] == 1 and expired["files_deleted"] >= 1
        assert query(db, "SELECT tier, record_path, n_tokens FROM caches WHERE agent_id = 'short'") == [
            ("cold", None, 0)]
        assert query(db, "SELECT count(*) FROM messages") == n_messages  # history kept
        referenced = [Path(p) for (p,) in query(db, "SELECT path FROM blocks UNION SELECT record_path FROM caches "
                                                    "WHERE record_path IS NOT NULL")]
        assert referenced and all(p.exists() for p in referenced)  # shared blocks "keep" uses stay
        assert set(cache_files(home)) == set(referenced)

        orphan = home / "blocks" / "orphan" / "left.safetensors"
        leftover = home / "blocks" / "orphan" / "half.safetensors.tmp"
        orphan.parent.mkdir(parents=True)
        for path in (orphan, leftover):
            path.write_bytes(b"x" * 100)
            os.utime(path, (time.time() - 7200, time.time() - 7200))
        (record,) = query(db, "SELECT record_path FROM caches WHERE agent_id = 'plain'")[0]
        data = bytearray(Path(record).read_bytes())
        data[-10] ^= 0xFF  # one flipped bit in the KV data
        Path(record).write_bytes(bytes(data))
        compacted = run_job(home, "compact")
        assert (compacted["orphan_files"], compacted["removed_temp_files"], compacted["damaged_caches"]) == (1, 1, 1)
        assert not orphan.exists() and not leftover.exists() and compacted["vacuumed"] is False
        assert (home / "blocks" / "quarantine" / Path(record).name).exists()
        assert query(db, "SELECT tier FROM caches WHERE agent_id = 'plain'") == [("cold",)]

        evicted = run_job(home, "evict", SEMANTIC_DISK_BUDGET_BYTES="1")
        assert evicted["conversations"] == [c for (c,) in query(
            db, "SELECT conversation_id FROM caches WHERE agent_id = 'keep'")]
        assert evicted["bytes_before"] > 0
        assert cache_files(home) == [] and query(db, "SELECT count(*) FROM blocks") == [(0,)]
        runs = query(db, "SELECT name, status FROM job_runs ORDER BY id")
        assert runs == [("expire", "ok"), ("compact", "ok"), ("evict", "ok")]
    finally:
        stop_server(server)

    server = start_server(home, smollm2_dir)  # the memory copies are gone: every cache is cold now
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        (reply,) = query(db, "SELECT json_extract(content, '$') FROM messages WHERE agent_id = 'keep' "
                             "AND role = 'assistant'")[0]
        again = client.chat.completions.create(model="m", max_tokens=4, temperature=0, extra_body={
            "session_id": "keep"}, messages=[SYSTEM, {"role": "user", "content": "Plan a trip for keep."},
                                             {"role": "assistant", "content": reply},
                                             {"role": "user", "content": "And a hotel?"}])
        assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.choices[0].message.content
        # The same conversation continues (one cache row), its cache written again from scratch.
        assert query(db, "SELECT tier FROM caches WHERE agent_id = 'keep'") in ([("cold",)], [("warm",)])
        wait_persisted(db, "keep", 512)  # written again, the cold row revived
        assert query(db, "SELECT tier FROM caches WHERE agent_id = 'keep'") == [("warm",)]
    finally:
        stop_server(server)
