"""Which server of a pool owns an agent's live cache, and since which epoch.

One row per agent: the owning server and an epoch that grows by one at every change of
owner, taken by compare-and-set under the store's write lock. A server serves what it
holds in memory for an agent only while the epoch it saw is current, and indexes a new
cache for the agent only while it still owns it: a server that comes back after a
failover neither serves nor writes back a stale cache.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.store.db import insert_or_ignore, write_locked
from app.store.models import Owner


def current(session: Session, agent_id: str) -> tuple[str, int] | None:
    """(owning server, epoch), or None if no server has claimed the agent."""
    row = session.execute(select(Owner.server_id, Owner.epoch).where(Owner.agent_id == agent_id)).first()
    return (row[0], int(row[1])) if row is not None else None


def claim(sessions: sessionmaker[Session], agent_id: str, server_id: str, now: datetime) -> int:
    """Make ``server_id`` the agent's owner if it is not; returns the current epoch.

    A read when the server already owns the agent (every request but the first after a
    move); otherwise one short write-locked transaction.
    """
    with sessions() as session:
        seen = current(session, agent_id)
    if seen is not None and seen[0] == server_id:
        return seen[1]
    with write_locked(sessions) as session:
        insert_or_ignore(session, Owner, agent_id=agent_id, server_id=server_id, epoch=1, taken_at=now)
        owner, epoch = current(session, agent_id) or (server_id, 1)
        if owner == server_id:
            return epoch
        session.execute(update(Owner).where(Owner.agent_id == agent_id, Owner.epoch == epoch)
                        .values(server_id=server_id, epoch=epoch + 1, taken_at=now))
        return epoch + 1


def still_owns(session: Session, agent_id: str, server_id: str, epoch: int) -> bool:
    return current(session, agent_id) == (server_id, epoch)


NOBODY = ""  # the owner of an agent its server released (drained): the next server claims it


def release_all(sessions: sessionmaker[Session], server_id: str, now: datetime) -> int:
    """A server leaving the pool gives up its agents; returns how many. The epoch still grows,
    so if this server comes back it drops what it held, as after any change of owner."""
    with write_locked(sessions) as session:
        result = session.execute(update(Owner).where(Owner.server_id == server_id)
                                 .values(server_id=NOBODY, epoch=Owner.epoch + 1, taken_at=now))
        return int(result.rowcount or 0)  # type: ignore[attr-defined]  # a DML result has one
