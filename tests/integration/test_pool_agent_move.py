"""An agent moves whole out of a pool and into one: export, run on a host that holds none
of the agent's cache files (they live only in the shared tier, a real moto S3 server),
fetches them into a temporary directory, not into its own home, and the archive carries the
request rows and the stored Responses objects; imported into another home the conversation
is warm, its rows are there and its response continues; imported into another pool its
files go to that pool's tier, from which a server with an empty disk restores it warm."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from support.dbcheck import query
from test_cache_round_trips import VOCAB, _record_fields, as_prompt, build, forward
from test_shared_tier import aws_credentials, s3_url  # noqa: F401  (fixtures)

from app.agents.portable import export_agent, import_agent
from app.cache.manager import CacheManager
from app.cache.records import CacheRecord
from app.cache.shared_tier import S3Tier
from app.cache.stager import Stager
from app.errors import InvalidRequest
from app.store import responses
from app.store.db import make_engine, make_session_factory, upgrade
from app.store.history import (
    StoredMessage,
    append_messages,
    ensure_conversation,
    start_request,
    touch_agent,
)
from app.clock import utcnow
from app.store.models import Request

FINGERPRINT = "5e" * 32  # an archive names its model by a sha256
MESSAGES = [StoredMessage("user", "what is in the box?", "d1"), StoredMessage("assistant", "a cat", "d2")]


def _store(db: Path) -> sessionmaker[Session]:
    url = f"sqlite:///{db}"
    upgrade(url)
    return make_session_factory(make_engine(url))


def _manager(sessions: sessionmaker[Session], root: Path, n_layers: int, tier: S3Tier | None) -> CacheManager:
    return CacheManager(fingerprint=FINGERPRINT, n_layers=n_layers, dtype=mx.float32, blocks_dir=root,
                        sessions=sessions, budget_bytes=1 << 30, tier=tier)


def _conversation(sessions: sessionmaker[Session], agent_id: str) -> str:
    with sessions() as session:
        (conversation,), = session.execute(select(Request.conversation_id).where(Request.agent_id == agent_id))
        return conversation


def test_an_agent_moves_whole_out_of_a_pool_and_into_one(tmp_path: Path, s3_url: str) -> None:  # noqa: F811
    model = build("llama")
    n_layers = len(model.layers)
    tokens = np.random.default_rng(21).integers(0, VOCAB, 600).tolist()
    more = np.random.default_rng(22).integers(0, VOCAB, 30).tolist()
    pool = _store(tmp_path / "pool.db")
    with pool.begin() as session:  # as the API does before a turn
        touch_agent(session, "a", "direct", utcnow())
        ensure_conversation(session, "c", "a", "direct", utcnow())
    server = _manager(pool, tmp_path / "s1" / "blocks", n_layers, S3Tier(s3_url))
    lease = server.lease("a", "c", as_prompt(tokens))
    forward(model, lease.cache, tokens)
    server.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    expected = forward(model, server.lease("a", "c", as_prompt(tokens + more)).cache, more)
    assert server.flush(60)
    server.close()
    with pool.begin() as session:  # the turn's log, as the Responses API leaves it
        now = utcnow()
        start_request(session, "req_1", protocol="responses", model="m", served_model="m", stream=False,
                      n_input_tokens=600, now=now)
        session.flush()
        row = session.get_one(Request, "req_1")
        row.agent_id, row.conversation_id, row.status = "a", "c", "ok"
        assert append_messages(session, "a", "c", MESSAGES, "req_1", now) == "c"
        responses.save(session, "resp_1", request_id="req_1", agent_id="a", conversation_id="c",
                       previous_response_id=None, now=now,
                       body={"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": []})
    shutil.rmtree(tmp_path / "s1")  # its host is gone: the files live only in the tier

    archive = io.BytesIO()
    cli_home = tmp_path / "cli" / "blocks"  # the host the export runs on: the pool's settings, nothing on disk
    manifest = export_agent(pool, cli_home, "a", archive, S3Tier(s3_url))
    assert not cli_home.exists()  # fetched into a temporary directory, not into this home
    assert len(manifest["files"]) == 3  # two blocks and the record, from the tier
    assert [r["id"] for r in manifest["requests"]] == ["req_1"]
    assert [r["id"] for r in manifest["responses"]] == ["resp_1"]

    # Another home (one server, SQLite, no tier): warm, its log there, its response continues.
    other = _store(tmp_path / "other.db")
    archive.seek(0)
    imported = import_agent(other, tmp_path / "other" / "blocks", archive)
    assert (imported.n_requests, imported.n_responses, imported.n_log_skipped) == (1, 1, 0)
    conversation = _conversation(other, "a")
    assert conversation != "c"
    with other() as session:
        point = responses.point(session, "resp_1")
    assert point is not None and (point.agent_id, point.conversation_id) == ("a", conversation)
    assert point.items == tuple(m.content for m in MESSAGES)
    assert query(tmp_path / "other.db", "SELECT request_id FROM messages ORDER BY position") == [("req_1",), ("req_1",)]
    assert query(tmp_path / "other.db", "SELECT request_id FROM responses") == [("req_1",)]
    landed = _manager(other, tmp_path / "other" / "blocks", n_layers, None)
    lease = landed.lease("a", conversation, as_prompt(tokens + more))
    assert (lease.n_reused, lease.report.reason) == (600, "extend")
    assert mx.array_equal(forward(model, lease.cache, more), expected)
    landed.close()

    # Another pool: the rows go into its database and the files into its tier; a server of
    # it with an empty disk restores the conversation warm.
    second_tier = s3_url.replace("/pool?", "/second?")
    second = _store(tmp_path / "second.db")
    archive.seek(0)
    import_agent(second, tmp_path / "importer" / "blocks", archive, tier=S3Tier(second_tier))
    shutil.rmtree(tmp_path / "importer")
    conversation = _conversation(second, "a")
    with second() as session:
        assert responses.point(session, "resp_1").conversation_id == conversation
    restoring = _manager(second, tmp_path / "s2" / "blocks", n_layers, S3Tier(second_tier))
    Stager(tmp_path / "s2" / "blocks", second, S3Tier(second_tier)).stage(restoring.fingerprint, conversation)
    lease = restoring.lease("a", conversation, as_prompt(tokens + more))
    assert (lease.n_reused, lease.report.reason) == (600, "extend")
    assert mx.array_equal(forward(model, lease.cache, more), expected)
    restoring.close()


def _with_manifest(archive: bytes, change: Callable[[dict], None]) -> io.BytesIO:
    """The archive with its agent.json changed (its files' list still right: a forger's)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r|") as source, tarfile.open(fileobj=out, mode="w|") as target:
        for member in source:
            data = source.extractfile(member).read()
            if member.name == "agent.json":
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            target.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


def test_an_archives_log_rows_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    """Request rows and responses are checked against their columns before anything is
    written: a wrong type, an overlong id, a response of a conversation the archive lacks."""
    source = _store(tmp_path / "source.db")
    with source.begin() as session:
        now = utcnow()
        ensure_conversation(session, "c", "a", "direct", now)
        start_request(session, "req_1", protocol="responses", model="m", served_model="m", stream=False,
                      n_input_tokens=10, now=now)
        session.flush()
        row = session.get_one(Request, "req_1")
        row.agent_id, row.conversation_id, row.status = "a", "c", "ok"
        append_messages(session, "a", "c", MESSAGES, "req_1", now)
        responses.save(session, "resp_1", request_id="req_1", agent_id="a", conversation_id="c",
                       previous_response_id=None, now=now, body={"id": "resp_1", "status": "completed"})
    archive = io.BytesIO()
    export_agent(source, tmp_path / "source", "a", archive)
    forgeries = {
        "a count that is text": lambda m: m["requests"][0].update(n_input_tokens="many"),
        "an id past its column": lambda m: m["requests"][0].update(id="r" * 65),
        "a body that is a list": lambda m: m["responses"][0].update(body=[]),
        "a response of another conversation": lambda m: m["responses"][0].update(conversation_id="elsewhere"),
        "a time that is not one": lambda m: m["responses"][0].update(created_at="yesterday"),
    }
    target = _store(tmp_path / "target.db")
    for name, change in forgeries.items():
        with pytest.raises(InvalidRequest, match="archive"):
            import_agent(target, tmp_path / "target", _with_manifest(archive.getvalue(), change))
        assert query(tmp_path / "target.db", "SELECT count(*) FROM agents") == [(0,)], name
        assert query(tmp_path / "target.db", "SELECT count(*) FROM requests") == [(0,)], name
    imported = import_agent(target, tmp_path / "target", io.BytesIO(archive.getvalue()))
    assert (imported.n_requests, imported.n_responses) == (1, 1)
