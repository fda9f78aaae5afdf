"""No agent's cache can be poisoned through a file it did not compute: a file found at a
block's address is never adopted unless it is this home's (reliability round 4, item 1), and
an imported record's tail never reaches another agent (issue 35, item 1). The archive's
blocks are tested end to end in e2e/test_agent_transfer.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.agents.portable import export_agent, import_agent
from app.cache import files
from app.cache.hashing import BLOCK_TOKENS, chain_hashes
from app.cache.records import CacheRecord
from app.store.db import make_engine, make_session_factory
from app.types import ForkPoint
from support.archives import pack, unpack
from support.dbcheck import query
from test_cache_round_trips import VOCAB, _record_fields, as_prompt, build, forward, manager, store_turn


def _forge(path: Path) -> None:
    """Rewrite a block file's arrays with noise of the same shapes, its checksum recomputed:
    it verifies on its own, as a forger would make it."""
    arrays, meta = files.read(path)
    rng = np.random.default_rng(0)
    forged = {name: rng.integers(0, 255, a.shape).astype(a.dtype) if a.dtype.kind in "ui"
              else rng.standard_normal(a.shape).astype(a.dtype) for name, a in arrays.items()}
    files.write(path, forged, meta)


def _shared_logits(home: Path, model, n_layers: int, tokens: list[int], more: list[int]) -> mx.array:  # type: ignore[no-untyped-def]
    """Another agent's turn after a restart, starting from the blocks stored for ``tokens``."""
    caches = manager(home, n_layers)
    lease = caches.lease("b", "other", as_prompt(tokens + more))
    assert (lease.report.reason, lease.n_reused) == ("shared", 2 * BLOCK_TOKENS)
    logits = forward(model, lease.cache, (tokens + more)[lease.n_reused:])
    caches.close()
    return logits


def test_a_file_found_at_a_block_address_is_replaced_unless_it_is_this_homes(tmp_path: Path) -> None:
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, VOCAB, 600).tolist()  # two full blocks and a tail
    more = rng.integers(0, VOCAB, 40).tolist()

    honest = manager(tmp_path / "honest", n_layers)
    store_turn(honest, model, "c", tokens)
    assert honest.flush(60)
    honest.close()
    expected = _shared_logits(tmp_path / "honest", model, n_layers, tokens, more)

    # A home where a block file of the same id lies around before any turn computed it (left
    # by a refused import, a crash or a forger), verifying on its own.
    first = chain_hashes("fp-test", tokens, BLOCK_TOKENS)[0]
    layout = files.CacheFiles(tmp_path / "home" / "blocks", "fp-test")
    planted = layout.block_path(first)
    planted.parent.mkdir(parents=True)
    planted.write_bytes((tmp_path / "honest" / "blocks" / planted.relative_to(tmp_path / "home" / "blocks"))
                        .read_bytes())
    _forge(planted)
    forged_claim = files.read_metadata(planted)[files.CHECKSUM_KEY]

    caches = manager(tmp_path / "home", n_layers)
    store_turn(caches, model, "c", tokens)
    assert caches.flush(60)
    caches.close()
    (checksum,), = query(tmp_path / "home" / "semantic.db", f"SELECT checksum FROM blocks WHERE hash = '{first}'")
    assert checksum and checksum != forged_claim  # the home's own data, not the planted file's
    assert files.read_metadata(planted)[files.CHECKSUM_KEY] == checksum
    assert mx.array_equal(_shared_logits(tmp_path / "home", model, n_layers, tokens, more), expected)


# -- an archive's record tail (reliability issue 35, item 1) ------------------------------------

FINGERPRINT = "5e" * 32  # an import names model directories by a sha256


def _turn(caches, model, agent: str, conversation: str, tokens: list[int]) -> int:  # type: ignore[no-untyped-def]
    lease = caches.lease(agent, conversation, as_prompt(tokens))
    forward(model, lease.cache, tokens[lease.n_reused:])
    caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    assert caches.flush(60)
    return lease.n_reused


def _neighbour(caches, model, tokens: list[int]) -> tuple[int, mx.array]:  # type: ignore[no-untyped-def]
    """Another agent's first turn (nothing of its own stored): what it reuses and its logits."""
    lease = caches.lease("b", "neighbour", as_prompt(tokens))
    return lease.n_reused, forward(model, lease.cache, tokens[lease.n_reused:])


def _archive_with_a_forged_tail(source: Path, target: Path, scratch: Path) -> Path:
    """``source``'s archive with its record's tail KV replaced by noise, every checksum
    recomputed (the record file's own, the manifest's sha256 list): it verifies."""
    manifest, members = unpack(source)
    (record_name,) = [n for n in members if n.startswith("records/")]
    (scratch / "in.safetensors").write_bytes(members[record_name])
    arrays, meta = files.read(scratch / "in.safetensors")
    rng = np.random.default_rng(5)
    assert any(name.startswith("tail.") for name in arrays)
    forged = {name: a if not name.startswith("tail.") else
              rng.integers(0, 255, a.shape).astype(a.dtype) if a.dtype.kind in "ui"
              else (rng.standard_normal(a.shape) * 4).astype(a.dtype) for name, a in arrays.items()}
    files.write(scratch / "out.safetensors", forged, meta)
    members[record_name] = (scratch / "out.safetensors").read_bytes()
    return pack(target, manifest, members)


@pytest.mark.parametrize("n_record,who", [(600, "own"), (100, "own"), (600, "copy"), (600, "cut")])
def test_an_archives_record_tail_reaches_no_other_agent(n_record: int, who: str, tmp_path: Path) -> None:
    """An imported record's tail (the KV past its last full block) is the archive's data too.
    The imported agent's next turns fill it into full blocks; whatever their parent blocks
    (here this home's own: the archive's blocks equal them byte for byte), those blocks never
    get an id another agent's prompt hashes to. Nor after a restart (the record rewritten),
    nor in a fork of the conversation (a whole copy, or cut inside the tail)."""
    model = build("llama")
    n_layers = len(model.layers)
    system = np.random.default_rng(12).integers(0, VOCAB, 1200).tolist()  # a long shared system prompt

    # Another home's agent, its record two full blocks and a tail (or a tail alone), exported.
    source = manager(tmp_path / "source", n_layers, FINGERPRINT, agents=("a",))
    _turn(source, model, "a", "c", system[:n_record])
    source.close()
    archive = tmp_path / "a.tar"
    with open(archive, "wb") as out:
        export_agent(make_session_factory(make_engine(f"sqlite:///{tmp_path / 'source' / 'semantic.db'}")),
                     tmp_path / "source" / "blocks", "a", out)
    forged = _archive_with_a_forged_tail(archive, tmp_path / "forged.tar", tmp_path)

    # This home computed the same start itself: the archive's blocks are its own, byte for byte.
    home = tmp_path / "home"
    caches = manager(home, n_layers, FINGERPRINT, agents=("h", "b", "forked"))
    _turn(caches, model, "h", "honest", system[:n_record])
    expected = _neighbour(caches, model, system)  # another agent, before any import
    assert expected[0] == n_record // BLOCK_TOKENS * BLOCK_TOKENS
    caches.close()

    sessions = make_session_factory(make_engine(f"sqlite:///{home / 'semantic.db'}"))
    with open(forged, "rb") as source_file:
        imported = import_agent(sessions, home / "blocks", source_file, "forger")
    assert imported.n_blocks_new == 0  # its blocks are this home's own: public
    ((conversation,),) = query(home / "semantic.db", "SELECT conversation_id FROM caches WHERE agent_id = 'forger'")

    caches = manager(home, n_layers, FINGERPRINT, agents=("h", "b", "forked"))
    agent = "forger"
    if who != "own":  # a fork of the imported conversation: a whole copy, or cut inside the tail
        lease = caches.lease("forger", conversation, as_prompt(system[:n_record]))
        assert lease.n_reused == n_record - 1  # an exact repeat leaves its last token to decode
        point = None if who == "copy" else ForkPoint(kept=(), dropped=lease.record.text[n_record - 30:n_record - 20])
        assert caches.fork(conversation, "forked", "fork", point).wait(60)
        assert caches.flush(60)
        agent, conversation = "forked", "fork"
    reused = _turn(caches, model, agent, conversation, system[:700])  # rewrites the record, tainted
    assert (reused == n_record) if who != "cut" else (512 < reused <= n_record - 30)  # the archive's tail: its own
    caches.close()

    caches = manager(home, n_layers, FINGERPRINT, agents=("h", "b", "forked"))  # a restart
    # Fills the tail into block 2 (its keys are grouped: full blocks hold no float16 keys).
    assert _turn(caches, model, agent, conversation, system[:900]) == 700
    n_reused, logits = _neighbour(caches, model, system)
    assert n_reused == expected[0]  # before the fix: 768, block 2 holding the archive's tail
    assert mx.array_equal(logits, expected[1])
    caches.close()


def _halve(path: Path) -> None:
    """Rewrite a block file with half its KV heads, its checksum recomputed: it verifies on
    its own, but no working copy can be built from it."""
    arrays, meta = files.read(path)
    files.write(path, {name: np.ascontiguousarray(a[:, :, : a.shape[2] // 2]) for name, a in arrays.items()}, meta)


@pytest.mark.parametrize("path", ["lease", "prefetch"])
@pytest.mark.parametrize("forge", [_halve, _forge], ids=["other shapes", "noise"])
def test_a_block_file_forged_to_verify_alone_is_a_miss_and_quarantined(tmp_path: Path, path: str, forge) -> None:  # type: ignore[no-untyped-def]
    """A restore builds its working copy from the blocks as read while their checksums are
    checked (``loading.Loader._restoring``). A block file replaced by one that verifies on its
    own (noise of the same shapes, or arrays of other shapes: half the KV heads, from which
    the working copy cannot be built) makes the restore a miss with nothing of it in memory,
    not an error, whether a turn asks for the conversation or the prefetch after a start
    brings it back; the turn is then answered cold. The forged file is quarantined (it is not
    the file its index row names), and the turn's commit writes the home's own block there."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(21)
    tokens = rng.integers(0, VOCAB, 600).tolist()  # two full blocks and a tail
    caches = manager(tmp_path, n_layers)
    store_turn(caches, model, "c", tokens)
    assert caches.flush(60)
    caches.close()

    first = chain_hashes("fp-test", tokens, BLOCK_TOKENS)[0]  # the chain's first: no block before it to share
    block = next((tmp_path / "blocks").rglob(f"{first}.safetensors"))
    (indexed,), = query(tmp_path / "semantic.db", f"SELECT checksum FROM blocks WHERE hash = '{first}'")
    forge(block)
    forged = files.read_metadata(block)[files.CHECKSUM_KEY]
    assert forged != indexed

    restarted = manager(tmp_path, n_layers)
    if path == "prefetch":
        while restarted.prefetch():
            pass
        assert restarted.record("c") is None and "c" not in restarted._working
    more = rng.integers(0, VOCAB, 20).tolist()
    lease = restarted.lease("a", "c", as_prompt(tokens + more))
    assert (lease.report.reason, lease.n_reused) == ("miss", 0)
    assert not restarted._blocks  # nothing of what was read is in memory
    quarantined = list(files.quarantined_files(tmp_path / "blocks"))
    assert [files.read_metadata(q)[files.CHECKSUM_KEY] for q in quarantined] == [forged]  # only the forged file
    logits = forward(model, lease.cache, tokens + more)
    restarted.commit(lease, CacheRecord(*_record_fields(tokens + more)), lease.cache)
    assert restarted.flush(60)
    restarted.close()
    cold = forward(model, [type(layer)() for layer in lease.cache], tokens + more)
    assert mx.array_equal(logits, cold)
    (rewritten,), = query(tmp_path / "semantic.db", f"SELECT checksum FROM blocks WHERE hash = '{first}'")
    assert files.read_metadata(block)[files.CHECKSUM_KEY] == rewritten != forged
    files.read(block, rewritten)  # the home's own block, verified against its row


@pytest.mark.parametrize("where", ["blocks", "working copy"])
@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("[metal::malloc] Attempting to allocate 9 GB")],
                         ids=["MemoryError", "MLX allocator"])
def test_running_out_of_memory_while_restoring_is_a_miss_that_keeps_the_cache(  # type: ignore[no-untyped-def]
        tmp_path: Path, monkeypatch, error, where) -> None:
    """Issue 59, item 8: memory that runs out while a cache is read back (its blocks made into
    arrays, or its working copy built) says nothing of its files: the turn is a miss, nothing is
    quarantined, and the next restore reads it whole."""
    from app.cache import loading

    model = build("llama")
    tokens = np.random.default_rng(5).integers(0, VOCAB, 600).tolist()
    caches = manager(tmp_path, len(model.layers))
    store_turn(caches, model, "c", tokens)
    assert caches.flush(60)
    caches.close()

    restarted = manager(tmp_path, len(model.layers))

    def exhausted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise error
        yield  # a generator, as to_working_cache_steps is

    with monkeypatch.context() as patched:
        if where == "blocks":
            patched.setattr(loading.KVBlock, "from_numpy", lambda *a, **k: (_ for _ in ()).throw(error))
        else:
            patched.setattr(loading, "to_working_cache_steps", exhausted)
        lease = restarted.lease("a", "c", as_prompt(tokens + [7]))
        assert lease.report.reason in ("miss", "shared")  # (the blocks read may serve as shared ones)
    assert not list(files.quarantined_files(tmp_path / "blocks"))
    again = restarted.lease("a", "c", as_prompt(tokens + [7]))
    assert again.n_reused == len(tokens)
    restarted.close()
