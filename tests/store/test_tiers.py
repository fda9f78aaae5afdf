"""The one definition of hot, warm and cold (``cache_index.Tier``), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime

from app.store.cache_index import TierCounts, count_tiers, tier_of
from app.store.db import make_engine, make_session_factory, upgrade
from app.store.models import Agent, Cache, Conversation


def test_tier_of_a_conversation() -> None:
    assert tier_of(True, ()) == tier_of(True, ["cold"]) == "hot"  # memory first, whatever the store says
    assert tier_of(False, ["cold", "warm"]) == "warm"  # on disk for some model
    assert tier_of(False, ["cold", "cold"]) == tier_of(False, ()) == "cold"


def test_conversations_are_counted_by_tier_once_each(store_url: str) -> None:
    upgrade(store_url)
    engine = make_engine(store_url)
    now = datetime(2026, 11, 1)
    try:
        with make_session_factory(engine)() as session:
            session.add(Agent(id="a", origin="direct", created_at=now, last_access_at=now, status="active",
                              metadata_json={}))
            session.flush()
            for conversation, tiers in (("hot", ["warm"]), ("warm", ["warm", "warm"]), ("mixed", ["cold", "warm"]),
                                        ("cold", ["cold", "cold"]), ("hot-cold", ["cold"])):
                session.add(Conversation(id=conversation, agent_id="a", created_at=now, last_access_at=now))
                session.flush()
                session.add_all(Cache(agent_id="a", conversation_id=conversation, model_fingerprint=f"fp{i}",
                                      tier=tier, created_at=now, updated_at=now, last_access_at=now)
                                for i, tier in enumerate(tiers))
            session.commit()
            assert count_tiers(session, ()) == TierCounts(0, 3, 2)
            # in memory: counted hot only; "new" has no row yet
            assert count_tiers(session, {"hot", "hot-cold", "new"}) == TierCounts(3, 2, 1)
    finally:
        engine.dispose()
