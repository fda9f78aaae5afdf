"""Requests a server left running (issue 59, item 9: 24 rows stayed `running` forever after
SIGKILLs, 2 after a full disk) are marked `interrupted` by its next start, on SQLite and
PostgreSQL; in a pool (a shared store) only that server's, never what the others are running."""
from __future__ import annotations

from typing import Any

from sqlalchemy import text

from app.agents.service import AgentService
from app.store.db import make_engine, make_session_factory, upgrade


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with make_engine(url).connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def test_a_start_marks_the_requests_its_server_left_running_interrupted(store_url: str) -> None:
    upgrade(store_url)
    sessions = make_session_factory(make_engine(store_url))
    first, second = AgentService(sessions, "host-a-8000"), AgentService(sessions, "host-b-8000")
    for service, request in ((first, "ra1"), (first, "ra2"), (second, "rb1")):
        service.begin(request, protocol="anthropic", model="m", served_model="m", stream=False, n_input_tokens=3)
    # In a pool, host-a's start touches none of host-b's requests.
    assert first.interrupt_unfinished(alone=False) == 2
    assert dict(rows(store_url, "SELECT id, status FROM requests")) == {
        "ra1": "interrupted", "ra2": "interrupted", "rb1": "running"}
    assert rows(store_url, "SELECT server_id, error_type FROM requests WHERE id = 'ra1'") == [
        ("host-a-8000", "interrupted")]
    assert first.interrupt_unfinished(alone=False) == 0  # once
    # The store's only server (SQLite: one a home) marks every running row, whoever's.
    assert second.interrupt_unfinished(alone=True) == 1
    assert dict(rows(store_url, "SELECT id, status FROM requests"))["rb1"] == "interrupted"
