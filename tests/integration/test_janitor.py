"""Each host cleans up after itself: a pool server's janitor (``app/cache/janitor.py``,
started as ``semantic serve`` starts it, ``main.start_janitor``) deletes, on its own disk,
the copies of the shared tier's files (a real moto S3 server) that no row names any more,
the copies beyond its local budget that the tier still holds, and the quarantined files
past their retention; a copy the tier lost or holds damaged stays, and the conversation it serves is
restored warm after the sweep."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from support.dbcheck import query
from support.history_rows import add_conversations
from test_cache_round_trips import VOCAB, _record_fields, as_prompt, build, forward
from test_shared_tier import aws_credentials, s3_url, server, stage  # noqa: F401  (fixtures)

from app.cache import files
from app.cache.janitor import JOB_NAME
from app.cache.manager import CacheManager
from app.cache.records import CacheRecord
from app.cache.shared_tier import S3Tier
from app.cache.upkeep import run_expire
from app.main import start_janitor
from app.settings import Settings
from app.store.db import make_engine, make_session_factory
from app.clock import utcnow
from app.store.history import touch_agent

HOUR_AGO = time.time() - 3600


def _store(manager: CacheManager, model: object, agent: str, conversation: str, seed: int) -> list[int]:
    """A 600-token conversation (two full blocks and a tail), written, indexed and uploaded."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, 600).tolist()
    lease = manager.lease(agent, conversation, as_prompt(tokens))
    forward(model, lease.cache, tokens)
    manager.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    assert manager.flush(60)
    return tokens


def _age(paths: list[Path], when: float) -> None:
    for path in paths:
        os.utime(path, (when, when))


def _wait_for_sweeps(db: Path, servers: set[str], timeout_s: float = 60) -> None:
    """Until every server in ``servers`` recorded a janitor sweep in job_runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [json.loads(result) for result, in query(db, f"SELECT result FROM job_runs WHERE name = '{JOB_NAME}'")]
        if servers <= {run["server"] for run in runs}:
            return
        time.sleep(0.2)
    pytest.fail(f"no janitor sweep of {servers} recorded in {timeout_s} s")


def test_a_servers_janitor_cleans_its_own_copies_and_quarantine(tmp_path: Path, s3_url: str) -> None:  # noqa: F811
    model = build("llama")
    n_layers = len(model.layers)
    tier = S3Tier(s3_url)
    a = server(tmp_path, "a", n_layers, tier)  # the host whose worker runs the jobs
    sessions = make_session_factory(make_engine(f"sqlite:///{tmp_path / 'pool.db'}"))
    with sessions.begin() as session:
        touch_agent(session, "z", "direct", utcnow(), ttl_seconds=1)
    add_conversations(sessions, "a", ("c",))  # as the API does before a turn
    add_conversations(sessions, "z", ("d",))
    kept = _store(a, model, "a", "c", seed=11)
    _store(a, model, "z", "d", seed=12)
    a.close()

    b = server(tmp_path, "b", n_layers, tier)  # another host: restores both from the tier
    stage(tmp_path, "b", tier, b, "c")
    stage(tmp_path, "b", tier, b, "d")
    b.close()
    b_root = tmp_path / "b" / "blocks"
    copies = sorted(b_root.rglob("*.safetensors"))
    assert len(copies) == 6  # two blocks and a record each
    # The worker (on a's host) expires agent z: its rows and a's files go, b's copies stay.
    assert run_expire(sessions, 24 * 3600, utcnow() + timedelta(minutes=1))["expired"] == 1
    (record_c,), = query(tmp_path / "pool.db", "SELECT record_path FROM caches WHERE conversation_id = 'c'")
    blocks_c = [path for path, in query(tmp_path / "pool.db", "SELECT path FROM blocks ORDER BY path")]
    key = Path(blocks_c[0]).relative_to(tmp_path / "a" / "blocks").as_posix()
    tier.delete([key])  # the tier lost one of c's blocks: b's copy is the only one left
    lost_copy = b_root / key
    damaged_key = Path(blocks_c[1]).relative_to(tmp_path / "a" / "blocks").as_posix()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\0" * (b_root / damaged_key).stat().st_size)
    tier.put(damaged_key, damaged)  # the tier holds the other one, damaged: a HEAD still answers it
    damaged_copy = b_root / damaged_key
    _age(copies, HOUR_AGO - 60)
    _age([lost_copy], HOUR_AGO - 120)  # the least recently used of all: first in line, were it held
    quarantine = b_root / "quarantine"
    quarantine.mkdir()
    (quarantine / "old.safetensors").write_bytes(b"damaged")
    (quarantine / "new.safetensors").write_bytes(b"damaged")
    _age([quarantine / "old.safetensors"], time.time() - 8 * 86400)
    a_files = sorted((tmp_path / "a" / "blocks").rglob("*.safetensors"))
    _age(a_files, HOUR_AGO)
    stray = tmp_path / "a" / "blocks" / "fp-pool" / "conversations" / "left-by-a-crash.safetensors"
    stray.write_bytes(a_files[0].read_bytes())  # a file no row names, within a's budget
    _age([stray], HOUR_AGO)

    # b keeps 1 byte of cache files, a the default budget (disk_budget_bytes, 20 GiB).
    janitors = [start_janitor(Settings(home=tmp_path / name, janitor_interval_s=1, local_disk_budget_bytes=budget,
                                       server_id=name), sessions, tier) for name, budget in (("a", 0), ("b", 1))]
    try:
        _wait_for_sweeps(tmp_path / "pool.db", {"a", "b"})
    finally:
        for janitor in janitors:
            assert janitor is not None
            janitor.stop()

    left = sorted(files.cache_files(b_root))  # the quarantine aside
    # d's copies (no row) went; of c's, over budget, those the tier holds a copy of: not the
    # one it lost, nor the one whose bytes in the tier differ (the pool's only good copy).
    assert left == sorted([lost_copy, damaged_copy]), left
    assert sorted(quarantine.iterdir()) == [quarantine / "new.safetensors"]
    # a's files are named by rows and within its budget: they stay; the one no row names goes.
    assert sorted((tmp_path / "a" / "blocks").rglob("*.safetensors")) == a_files
    assert str(record_c) in map(str, a_files)

    # (a's disk stands for its host lost: b restores c from the tier and its own kept copy)
    for path in a_files:
        path.unlink()
    b = server(tmp_path, "b", n_layers, tier)
    more = np.random.default_rng(13).integers(0, VOCAB, 30).tolist()
    lease = b.lease("a", "c", as_prompt(kept + more))
    assert (lease.n_reused, lease.report.reason) == (600, "extend")
    b.close()


def test_a_block_file_gone_before_its_upload_does_not_hold_back_the_record(tmp_path: Path,
                                                                         s3_url: str) -> None:  # noqa: F811
    """The janitor may delete a block file the tier holds while an upload naming it waits (a
    fork's upload names the blocks it shares): the uploader skips that block and still puts
    the record (before: the upload failed whole and the record stayed out of the tier)."""
    from app.cache.shared_tier import Upload, Uploader

    tier = S3Tier(s3_url.replace("/pool?", "/gone-block-test?"))
    uploader = Uploader(tier)
    uploader.start()
    record = tmp_path / "record"
    record.write_bytes(b"tokens")
    uploader.submit(Upload((("fp/aa/block.safetensors", tmp_path / "deleted"),),
                           ("fp/conversations/r.safetensors", record)))
    assert uploader.flush(30)
    assert uploader.n_failed == 0
    assert {key for key, _ in tier.listing()} == {"fp/conversations/r.safetensors"}
    uploader.stop()
