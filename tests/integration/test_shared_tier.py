"""The shared block tier: what one server of a pool stored, another restores from S3 (a
real moto S3 server on loopback) with exactly the logits the first would have given;
a tier that is down costs a miss, never a wrong answer, and a tampered object is refused."""

from __future__ import annotations

import threading

from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
import pytest

from app.cache import files
from app.cache.manager import CacheManager
from app.cache.records import CacheRecord
from app.cache.shared_tier import S3Tier
from app.cache.stager import Stager
from app.types import ForkPoint
from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow
from support.history_rows import add_conversations
from support.servers import free_port
from support.dbcheck import query
from test_cache_round_trips import VOCAB, _record_fields, as_prompt, build, forward


@pytest.fixture
def s3_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"s3://blocks/pool?endpoint=http://{host}:{port}"
    S3Tier(url).ensure_bucket()
    yield url
    server.stop()


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testtest")


def server(tmp_path: Path, name: str, n_layers: int, tier: S3Tier | None, **options: Any) -> CacheManager:
    """One server's cache manager: its own directory, the pool's database (one file here)."""
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    add_conversations(sessions, "a", ("c", "c2", "a-c"))  # as the API does before a turn
    return CacheManager(fingerprint="fp-pool", n_layers=n_layers, dtype=mx.float32, blocks_dir=tmp_path / name / "blocks",
                        sessions=sessions, budget_bytes=1 << 30, tier=tier, **options)


def stage(tmp_path: Path, name: str, tier: S3Tier, manager: Any, conversation_id: str) -> None:
    """What the engine does on a request's thread before the turn: the conversation's files
    for the manager's model brought from the tier into server ``name``'s directory."""
    sessions = make_session_factory(make_engine(f"sqlite:///{tmp_path / 'pool.db'}"))
    Stager(tmp_path / name / "blocks", sessions, tier).stage(manager.fingerprint, conversation_id)


def test_another_server_restores_a_conversation_from_the_tier(tmp_path: Path, s3_url: str) -> None:
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(3)
    first = rng.integers(0, VOCAB, 600).tolist()  # two full blocks and a tail
    more = rng.integers(0, VOCAB, 30).tolist()

    a = server(tmp_path, "a", n_layers, S3Tier(s3_url))
    lease = a.lease("a", "c", as_prompt(first))
    forward(model, lease.cache, first)
    a.commit(lease, CacheRecord(*_record_fields(first)), lease.cache)
    again = a.lease("a", "c", as_prompt(first + more))
    assert (again.report.source, again.report.n_tokens) == ("memory", 600)  # the writer's own: still in memory
    expected = forward(model, again.cache, more)
    assert a.flush(60)  # written, indexed and uploaded
    a.close()

    b = server(tmp_path, "b", n_layers, S3Tier(s3_url))  # another machine: nothing of a's on its disk
    assert not (tmp_path / "b" / "blocks").exists()
    # Staged from a request thread: the files come before the turn reaches the engine thread.
    staging = threading.Thread(target=stage, args=(tmp_path, "b", S3Tier(s3_url), b, "c"))
    staging.start()
    staging.join()
    assert len(list((tmp_path / "b" / "blocks").rglob("*.safetensors"))) == 3  # two blocks and the record
    lease = b.lease("a", "c", as_prompt(first + more))
    assert (lease.n_reused, lease.report.reason) == (600, "extend")
    # Its provenance: fetched from the tier (staged by the request thread), in the manager's format.
    assert (lease.report.source, lease.report.n_tokens, lease.report.kv_format) == ("tier", 600, b.kv_format.name)
    assert mx.array_equal(forward(model, lease.cache, more), expected)
    b.close()

    unshared = server(tmp_path, "c", n_layers, None)  # the same rows without the tier: a clean miss
    assert unshared.lease("a", "c", as_prompt(first + more)).n_reused == 0
    unshared.close()


def _stored_on_a(tmp_path: Path, s3_url: str, seed: int) -> tuple[int, list[int]]:
    """Server a stores a 600-token conversation "c" of agent "a" (two full blocks and a
    tail), written, indexed and uploaded; returns the model's layer count and the tokens."""
    model = build("llama")
    tokens = np.random.default_rng(seed).integers(0, VOCAB, 600).tolist()
    a = server(tmp_path, "a", len(model.layers), S3Tier(s3_url))
    lease = a.lease("a", "c", as_prompt(tokens))
    forward(model, lease.cache, tokens)
    a.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    assert a.flush(60)
    a.close()
    return len(model.layers), tokens


def test_a_tier_that_is_down_or_lies_costs_a_miss(tmp_path: Path, s3_url: str) -> None:
    n_layers, tokens = _stored_on_a(tmp_path, s3_url, seed=4)

    down = S3Tier(f"s3://blocks/pool?endpoint=http://127.0.0.1:{free_port()}", timeout_s=1)  # nothing listens
    b = server(tmp_path, "b", n_layers, down)
    assert b.lease("a", "c", as_prompt(tokens)).n_reused == 0
    b.close()

    tier = S3Tier(s3_url)
    (first_block,), = query(tmp_path / "pool.db", "SELECT hash FROM blocks WHERE parent_hash IS NULL")
    block = next((tmp_path / "a" / "blocks").rglob(f"{first_block}.safetensors"))
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    tier.put(block.relative_to(tmp_path / "a" / "blocks").as_posix(), damaged)  # the object no longer matches its checksum
    c = server(tmp_path, "c", n_layers, tier)
    assert c.lease("a", "c", as_prompt(tokens)).n_reused == 0
    c.close()


def test_a_record_rewritten_in_the_tier_with_its_checksum_recomputed_is_refused(tmp_path: Path, s3_url: str) -> None:
    """The record (tokens, text, the tail's KV) is checked against the index's checksum, as
    blocks are: a record object rewritten whole, its own checksum recomputed, is not used,
    and the damaged cache is forgotten."""
    n_layers, tokens = _stored_on_a(tmp_path, s3_url, seed=5)

    (record_path, stored), = query(tmp_path / "pool.db", "SELECT record_path, record_checksum FROM caches")
    arrays, meta = files.read(Path(record_path), stored)
    tail = next(name for name in arrays if name.startswith("tail.") and name.endswith(".v_w"))
    arrays[tail] = np.roll(arrays[tail], 1)  # another tail's values, every checksum of the file recomputed
    tampered = tmp_path / "tampered.safetensors"
    files.write(tampered, arrays, meta)
    tier = S3Tier(s3_url)
    tier.put(Path(record_path).relative_to(tmp_path / "a" / "blocks").as_posix(), tampered)

    b = server(tmp_path, "b", n_layers, tier)  # restores from the tier: nothing of a's on its disk
    lease = b.lease("a", "c", as_prompt(tokens))
    # Nothing of the record is used. The conversation's full blocks, which verify, may still
    # serve as a shared prefix, or be gone already: the discarded cache left them unreferenced
    # and the writer thread drops them (a race the test does not pin; CI saw both).
    assert (lease.report.reason, lease.n_reused <= 512) in (("shared", True), ("miss", True)), lease.report
    assert b.flush(30)
    assert query(tmp_path / "pool.db", "SELECT count(*) FROM caches") == [(0,)]  # the damaged cache is forgotten
    b.close()


def _a_turn_in_flight_on_a(tmp_path: Path, s3_url: str, seed: int):  # type: ignore[no-untyped-def]
    """Servers a and b of one pool: a stores agent a's 600-token turn of conversation c, then
    begins a 40-token turn (its lease taken under epoch 1). Returns the model, a, b, the
    token lists (first, late, more, other: 600, 40, 30 and 20 tokens) and that turn's lease."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(seed)
    first, late, more, other = (rng.integers(0, VOCAB, n).tolist() for n in (600, 40, 30, 20))
    a = server(tmp_path, "a", n_layers, S3Tier(s3_url), owner="a")
    b = server(tmp_path, "b", n_layers, S3Tier(s3_url), owner="b")
    lease = a.lease("a", "c", as_prompt(first))
    forward(model, lease.cache, first)
    a.commit(lease, CacheRecord(*_record_fields(first)), lease.cache)
    assert a.flush(60)
    in_flight = a.lease("a", "c", as_prompt(first + late))
    forward(model, in_flight.cache, late)
    return model, a, b, (first, late, more, other), in_flight


def test_a_server_that_lost_its_agent_neither_writes_nor_serves_its_stale_cache(tmp_path: Path, s3_url: str) -> None:
    """a serves the agent, is cut off mid-turn, b takes the agent over (epoch 2) and goes on;
    a's late turn is not indexed over b's, and a's next turn serves b's cache, not its own
    older copy. Without epochs the row would point at a's record and a would reuse 600."""
    # a's turn in flight when it is cut off
    model, a, b, (first, late, more, next_turn), cut_off = _a_turn_in_flight_on_a(tmp_path, s3_url, 5)

    lease = b.lease("a", "c", as_prompt(first + more))  # the router moved the agent: b owns it now
    assert lease.n_reused == 600
    forward(model, lease.cache, more)
    b.commit(lease, CacheRecord(*_record_fields(first + more)), lease.cache)
    assert b.flush(60)

    a.commit(cut_off, CacheRecord(*_record_fields(first + late)), cut_off.cache)  # a's late turn
    assert a.flush(60)
    assert query(tmp_path / "pool.db", "SELECT n_tokens FROM caches") == [(630,)]  # still b's
    assert query(tmp_path / "pool.db", "SELECT server_id, epoch FROM owners") == [("b", 2)]

    lease = a.lease("a", "c", as_prompt(first + more + next_turn))  # the agent comes back to a
    assert lease.n_reused == 630  # b's cache from the store, not a's own 640-token copy of another turn
    assert query(tmp_path / "pool.db", "SELECT server_id, epoch FROM owners") == [("a", 3)]
    a.close()
    b.close()


def test_a_turn_begun_under_an_older_epoch_is_not_stored_after_the_agent_came_back(tmp_path: Path,
                                                                                    s3_url: str) -> None:
    """The fence is the epoch at lease, not at commit: a's turn starts (epoch 1), b takes the
    agent over (epoch 2) and stores a turn, another turn brings the agent back to a (epoch 3),
    then a's first turn ends. It began before b's turn, so it is stored neither in the index nor
    in a's memory. Read at commit, epoch 3 was current: a's 640 tokens replaced b's 630."""
    # a's long turn, begun under epoch 1
    model, a, b, (first, late, more, other), slow = _a_turn_in_flight_on_a(tmp_path, s3_url, 7)

    lease = b.lease("a", "c", as_prompt(first + more))
    forward(model, lease.cache, more)
    b.commit(lease, CacheRecord(*_record_fields(first + more)), lease.cache)
    assert b.flush(60)
    a.lease("a", "c2", as_prompt(other))  # another of the agent's turns reaches a: epoch 3
    assert query(tmp_path / "pool.db", "SELECT server_id, epoch FROM owners") == [("a", 3)]

    a.commit(slow, CacheRecord(*_record_fields(first + late)), slow.cache)
    assert a.flush(60)
    assert query(tmp_path / "pool.db", "SELECT n_tokens FROM caches WHERE conversation_id = 'c'") == [(630,)]
    assert a.lease("a", "c", as_prompt(first + more + other)).n_reused == 630  # b's, from the store
    a.close()
    b.close()


def test_tier_gc_deletes_only_old_objects_no_row_names(tmp_path: Path, s3_url: str) -> None:
    from datetime import timedelta

    from app.cache.tier_gc import collect
    from app.store import cache_index
    from app.store.history import ensure_conversation

    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    fingerprint = "f" * 64
    tag = fingerprint[:16]
    kept, gone = "a" * 64, "b" * 64
    other_server = Path("/elsewhere/s2/blocks") / tag  # rows name the writing server's paths
    with sessions.begin() as session:
        ensure_conversation(session, "c1", "a", "direct", utcnow())
        cache_index.save_cache(session, "a", "c1", fingerprint, 256, str(other_server / "conversations" / "r2.safetensors"),
                               [cache_index.BlockRow(kept, None, 256, str(other_server / "aa" / f"{kept}.safetensors"),
                                                     1, "")], utcnow(), record_checksum=None)
    tier = S3Tier(s3_url.replace("/pool?", "/gc-test?"))  # moto keeps one store per process: a prefix of its own
    payload = tmp_path / "object"
    payload.write_bytes(b"x")
    named = {f"{tag}/aa/{kept}.safetensors", f"{tag}/conversations/r2.safetensors"}
    orphans = {f"{tag}/bb/{gone}.safetensors", f"{tag}/conversations/r1.safetensors"}  # dropped block, old record
    for key in named | orphans:
        tier.put(key, payload)

    assert collect(sessions, tier) == {"objects": 4, "unreferenced": 0, "deleted": 0}  # all younger than the grace
    assert collect(sessions, tier, grace=timedelta(0)) == {"objects": 4, "unreferenced": 2, "deleted": 2}
    assert {key for key, _ in tier.listing()} == named


def test_a_restarted_server_prefetches_only_the_agents_it_still_owns(tmp_path: Path, s3_url: str) -> None:
    """a served two agents, then b took one over; a restarted a brings back only the other
    one (without the owner check it would load b's agent, whose cache b may change)."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(6)
    a = server(tmp_path, "a", n_layers, S3Tier(s3_url), owner="a")
    add_conversations(a._index.sessions, "z", ("z-c",))
    tokens = {agent: rng.integers(0, VOCAB, 300).tolist() for agent in ("a", "z")}
    for agent, prompt in tokens.items():
        lease = a.lease(agent, f"{agent}-c", as_prompt(prompt))
        forward(model, lease.cache, prompt)
        a.commit(lease, CacheRecord(*_record_fields(prompt)), lease.cache)
    assert a.flush(60)
    a.close()
    b = server(tmp_path, "b", n_layers, S3Tier(s3_url), owner="b")
    assert b.lease("z", "z-c", as_prompt(tokens["z"] + [1, 2])).n_reused == 300  # b owns z now
    b.close()

    restarted = server(tmp_path, "a", n_layers, S3Tier(s3_url), owner="a")
    while restarted.prefetch():
        pass
    assert restarted.record("a-c") is not None and restarted.record("z-c") is None
    assert restarted._ownership.epoch("a") == 1 and restarted._ownership.epoch("z") is None
    restarted.close()


def test_a_block_the_tier_lost_is_a_miss_that_deletes_neither_the_row_nor_the_writers_files(
        tmp_path: Path, s3_url: str) -> None:
    """Server b (on the same machine as a, as a local pool runs) restores a conversation one
    of whose blocks the tier no longer holds: a miss, and nothing else. Before, the failed
    fetch was damage: b dropped the pool's ``caches`` row and unlinked the paths the row
    names, a's own files."""
    n_layers, tokens = _stored_on_a(tmp_path, s3_url, seed=8)
    rows = query(tmp_path / "pool.db", "SELECT conversation_id, n_tokens, record_path FROM caches")
    written = sorted((tmp_path / "a" / "blocks").rglob("*.safetensors"))
    (second,), = query(tmp_path / "pool.db", "SELECT hash FROM blocks WHERE parent_hash IS NOT NULL")
    tier = S3Tier(s3_url)
    lost = next(p for p in written if p.name == f"{second}.safetensors").relative_to(tmp_path / "a" / "blocks")
    assert tier.delete([lost.as_posix()]) == 1

    b = server(tmp_path, "b", n_layers, tier)
    assert b.lease("a", "c", as_prompt(tokens)).n_reused <= 256  # at most the first block, which b fetched
    assert b.flush(60)
    b.close()
    assert query(tmp_path / "pool.db", "SELECT conversation_id, n_tokens, record_path FROM caches") == rows
    assert all(path.exists() for path in written)  # a's files, untouched

    a = server(tmp_path, "a", n_layers, tier)  # a itself still serves it from its own disk
    assert a.lease("a", "c", as_prompt(tokens + [1])).n_reused == 600
    a.close()

    b = server(tmp_path, "b", n_layers, tier)
    assert b.forget_agent("a")(60)  # the pool's rows go; b deletes its own copies, never a's paths
    b.close()
    assert query(tmp_path / "pool.db", "SELECT count(*) FROM caches") == [(0,)]
    assert all(path.exists() for path in written)


def test_a_block_the_tier_lost_is_uploaded_again_by_the_server_that_uploaded_it(tmp_path: Path, s3_url: str) -> None:
    """The uploader skips blocks it put recently, not for the life of the process: once its
    memo of a block is older than ``memo_s`` the next upload that names the block asks the
    tier for it (a HEAD) and puts it again if lost, so a tier that lost the object gets it
    back (before: never, from that server); one the tier still holds is not sent again."""
    from app.cache.shared_tier import Upload, Uploader

    tier = S3Tier(s3_url.replace("/pool?", "/reupload-test?"))  # moto keeps one store per process
    now = [0.0]
    uploader = Uploader(tier, clock=lambda: now[0], memo_s=60)
    puts: list[str] = []
    real_put = tier.put

    def counted(key: str, path: Path, once: bool = False) -> bool:
        puts.append(key)
        return real_put(key, path, once)

    tier.put = counted  # type: ignore[method-assign]  (a spy: the real put still runs)
    uploader.start()
    block, record = tmp_path / "block", tmp_path / "record"
    block.write_bytes(b"kv")
    record.write_bytes(b"tokens")
    upload = Upload((("fp/aa/block.safetensors", block),), ("fp/conversations/r.safetensors", record))

    def keys() -> set[str]:
        uploader.submit(upload)
        assert uploader.flush(30) and uploader.n_failed == 0
        return {key for key, _ in tier.listing()}

    assert "fp/aa/block.safetensors" in keys()
    tier.delete(["fp/aa/block.safetensors"])  # the tier lost it
    assert "fp/aa/block.safetensors" not in keys()  # within the memo: not checked again
    now[0] += 60
    assert "fp/aa/block.safetensors" in keys()  # the memo expired: put again
    now[0] += 60
    n_puts = puts.count("fp/aa/block.safetensors")
    assert "fp/aa/block.safetensors" in keys()
    assert puts.count("fp/aa/block.safetensors") == n_puts  # held: asked for, not sent again
    uploader.stop()


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_a_hybrid_conversation_moves_through_the_tier_with_its_checkpoints(tmp_path: Path, s3_url: str,
                                                                           family: str) -> None:
    """Issue 37: a hybrid model's conversation stored on one server (its record carries the
    recurrent-state checkpoints) is restored on another from the tier alone, and the next
    turn's logits there are the first server's, bit for bit (f32)."""
    from app.cache import checkpoints
    from app.cache.formats import KV_FORMATS
    from app.cache.checkpoints import CacheLayout
    from support.families import HYBRID
    from support.families import build as build_family
    from test_checkpoints import prefill

    model = build_family(HYBRID[family])
    layout = CacheLayout.of(model)
    options = {"kv_format": KV_FORMATS["f32"], "layout": layout}
    s3_url = s3_url.replace("/pool?", f"/{family}?")  # moto keeps one store per process: a prefix of its own
    rng = np.random.default_rng(5)
    first, more = rng.integers(100, 15000, 700).tolist(), rng.integers(100, 15000, 20).tolist()

    a = server(tmp_path, "a", layout.n_attention, S3Tier(s3_url), **options)
    lease = a.lease("a", "c", as_prompt(first))
    lease.plan.positions = checkpoints.plan(0, len(first))
    prefill(model, lease.cache, first, 0, lease.plan)
    a.commit(lease, CacheRecord(*_record_fields(first)), lease.cache)
    expected = prefill(model, a.lease("a", "c", as_prompt(first + more)).cache, more, len(first), None)
    assert a.flush(60)
    a.close()

    b = server(tmp_path, "b", layout.n_attention, S3Tier(s3_url), **options)
    assert not (tmp_path / "b" / "blocks").exists()
    stage(tmp_path, "b", S3Tier(s3_url), b, "c")
    lease = b.lease("a", "c", as_prompt(first + more))
    assert (lease.n_reused, lease.report.reason) == (700, "extend"), lease.report
    assert mx.array_equal(prefill(model, lease.cache, more, len(first), None), expected)
    b.close()


def test_a_fork_on_another_server_copies_the_conversation_up_to_its_point_from_the_tier(
        tmp_path: Path, s3_url: str) -> None:
    """In a pool the fork may land on a server that never held the conversation: it reads the
    source from the tier and the forked agent gets its tokens before the point only; its next
    turn there gives the logits the source's own server gives for the same prefix."""
    n_layers, tokens = _stored_on_a(tmp_path, s3_url, seed=6)
    model = build("llama")
    more = np.random.default_rng(7).integers(0, VOCAB, 20).tolist()
    text = as_prompt(tokens).text
    point = ForkPoint(kept=(text[:300],), dropped=text[300:310])  # the fork leaves out tokens 300 on

    b = server(tmp_path, "b", n_layers, S3Tier(s3_url))  # nothing of a's on its disk
    add_conversations(make_session_factory(make_engine(f"sqlite:///{tmp_path / 'pool.db'}")), "forked", ("f",))
    assert b.fork("c", "forked", "f", point).wait(60)
    prompt = tokens[:300] + more
    lease = b.lease("forked", "f", as_prompt(prompt))
    assert lease.report.reason == "extend" and 0 < lease.n_reused <= 300, lease.report  # (cut to the format's groups)
    forked = forward(model, lease.cache, prompt[lease.n_reused:])
    (n_stored,), = query(tmp_path / "pool.db", "SELECT n_tokens FROM caches WHERE agent_id = 'forked'")
    assert n_stored <= 300  # nothing after the point reached the fork
    b.close()

    a = server(tmp_path, "a2", n_layers, S3Tier(s3_url))  # the source's own conversation, cut at the same place
    own = a.lease("a", "c", as_prompt(prompt))
    assert own.n_reused == lease.n_reused, own.report
    assert mx.array_equal(forward(model, own.cache, prompt[own.n_reused:]), forked)
    a.close()


def test_the_stager_fetches_the_files_of_the_model_the_request_names(tmp_path: Path, s3_url: str) -> None:
    """Staging is keyed by the cache fingerprint of the model a request names, not the model
    loaded: another model's fingerprint finds no row and fetches nothing; the stored model's
    brings its conversation's two blocks and record."""
    _stored_on_a(tmp_path, s3_url, seed=8)
    root = tmp_path / "b" / "blocks"
    stage(tmp_path, "b", S3Tier(s3_url), _Named("fp-other"), "c")
    assert not root.exists() or not list(root.rglob("*.safetensors"))
    stage(tmp_path, "b", S3Tier(s3_url), _Named("fp-pool"), "c")
    assert len(list(root.rglob("*.safetensors"))) == 3


class _Named:
    """What ``stage`` reads of a cache manager: its fingerprint."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
