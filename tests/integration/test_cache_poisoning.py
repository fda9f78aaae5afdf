"""No agent's cache can be poisoned through a file it did not compute: a file found at a
block's address is never adopted unless it is this home's (reliability round 4, item 1).
The archive side of the same guarantee is tested end to end in e2e/test_agent_transfer.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from app.cache import files
from app.cache.hashing import BLOCK_TOKENS, chain_hashes
from support.dbcheck import query
from test_cache_round_trips import VOCAB, as_prompt, build, forward, manager, store_turn


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
