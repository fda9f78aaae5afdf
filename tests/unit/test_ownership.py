"""``cache/ownership.py`` against a real SQLite store: two servers of a pool claim an agent in
turn; each one's view of it (claim, still-mine, the epoch fence of a turn) follows the
store, and outside a pool every agent is the server's without a query."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.cache.ownership import Ownership
from app.store.cache_index import CacheIndex
from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    return make_session_factory(make_engine(url))


def test_a_claim_remembers_the_epoch_and_a_move_fences_the_older_turn(sessions: sessionmaker[Session]) -> None:
    index = CacheIndex(sessions, "fp")
    a, b = Ownership(index, "a"), Ownership(index, "b")
    assert a.claim("x") == "mine" and a.epoch("x") == 1
    assert a.claim("x") == "mine" and a.current("x", 1)  # a second claim of its own agent changes nothing
    assert b.claim("x") == "mine"  # b had seen no epoch of x: nothing of it in its memory
    assert b.epoch("x") == 2 and b.still_mine("x")
    assert not a.still_mine("x")  # b took it: a no longer prefetches it
    assert a.claim("x") == "moved" and a.epoch("x") == 3  # back to a: what a held for x is stale
    assert not a.current("x", 1)  # a turn a began at epoch 1 stores nothing
    assert a.current("x", 3)


def test_still_mine_takes_the_newer_epoch(sessions: sessionmaker[Session]) -> None:
    """A server that owns an agent again after another held it in between (its id claimed it
    anew, as a restarted process of it does) takes the newer epoch from still-mine: a turn
    leased at that epoch stores its cache, one leased at the epoch it saw before does not."""
    index = CacheIndex(sessions, "fp")
    a, b = Ownership(index, "a"), Ownership(index, "b")
    assert a.claim("x") == "mine" and a.epoch("x") == 1
    b.claim("x")  # epoch 2
    assert index.claim("x", "a", utcnow()) == 3  # a's id owns x again, not through this object
    assert a.still_mine("x") and a.epoch("x") == 3
    assert a.current("x", 3) and not a.current("x", 1)
    restarted = Ownership(index, "a")  # a after a restart: it has seen no epoch
    assert restarted.epoch("x") is None
    assert restarted.still_mine("x") and restarted.epoch("x") == 3


def test_release_all_gives_the_agents_up_and_the_next_claim_moves_them(sessions: sessionmaker[Session]) -> None:
    index = CacheIndex(sessions, "fp")
    a = Ownership(index, "a")
    a.claim("x")
    a.claim("y")
    a.release_all()
    assert index.owner("x") == ("", 2) and index.owner("y") == ("", 2)
    assert not a.still_mine("x")
    assert a.claim("x") == "moved" and a.epoch("x") == 3  # it owned x at epoch 1: what it holds goes


def test_outside_a_pool_every_agent_is_the_servers_and_the_store_is_never_asked() -> None:
    class Unreachable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the store was asked ({name})")

    alone = Ownership(Unreachable(), None)  # type: ignore[arg-type]
    assert alone.claim("x") == "mine" and alone.still_mine("x") and alone.epoch("x") is None
    assert alone.current("x", None) and alone.current("x", 7)
    alone.release_all()


def test_a_store_that_cannot_be_reached_makes_the_claim_unreachable(sessions: sessionmaker[Session]) -> None:
    class Down(CacheIndex):
        def claim(self, agent_id: str, server_id: str, now: object) -> int:  # type: ignore[override]
            raise ConnectionError("the store is down")

    down = Ownership(Down(sessions, "fp"), "a")
    assert down.claim("x") == "unreachable" and down.epoch("x") is None
