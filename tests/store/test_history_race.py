"""Two racing turns of one conversation: both turns' history is kept (real SQLite and PostgreSQL stores)."""

from __future__ import annotations


from sqlalchemy import select

from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow
from app.store.history import StoredMessage, append_messages, ensure_conversation, start_request
from app.store.models import Conversation, Message


def _messages(*texts: str) -> list[StoredMessage]:
    return [StoredMessage("user" if i % 2 == 0 else "assistant", text, f"d-{text}") for i, text in enumerate(texts)]


def test_the_turn_that_finishes_second_forks_instead_of_vanishing(store_url: str) -> None:
    url = store_url
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as session:
        ensure_conversation(session, "c", "a", "direct", utcnow(), system_digest="s", thread="t")
        for request in ("r0", "rA", "rB", "rC"):
            start_request(session, request, protocol="direct", model=None, served_model=None, stream=False,
                          n_input_tokens=None, now=utcnow())
        assert append_messages(session, "a", "c", _messages("hi", "hello"), "r0", utcnow()) == "c"
    # Both turns resolved to "c" (two messages stored); A finishes first, then B.
    with sessions.begin() as session:
        assert append_messages(session, "a", "c", _messages("hi", "hello", "a?", "A!"), "rA", utcnow()) == "c"
    with sessions.begin() as session:
        fork = append_messages(session, "a", "c", _messages("hi", "hello", "b?", "B!"), "rB", utcnow())
    with sessions() as session:
        def contents(conversation: str) -> list[str]:
            return list(session.scalars(select(Message.content).where(Message.conversation_id == conversation)
                                        .order_by(Message.position)))

        assert fork != "c"
        assert contents("c") == ["hi", "hello", "a?", "A!"]
        assert contents(fork) == ["hi", "hello", "b?", "B!"]
        copy = session.get_one(Conversation, fork)
        assert (copy.agent_id, copy.system_digest, copy.thread) == ("a", "s", "t")
    with sessions.begin() as session:  # a turn that continues A's version stays in "c"
        assert append_messages(session, "a", "c", _messages("hi", "hello", "a?", "A!", "more", "ok"),
                               "rC", utcnow()) == "c"


def test_a_request_without_a_session_never_reaches_a_named_agents_history(store_url: str) -> None:
    from app.store.history import find_by_content

    url = store_url
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as session:
        for agent, origin in (("alice", "anthropic"), ("anon", "content")):
            ensure_conversation(session, f"{agent}-c", agent, origin, utcnow(), system_digest=f"s-{agent}")
            start_request(session, f"r-{agent}", protocol="direct", model=None, served_model=None, stream=False,
                          n_input_tokens=None, now=utcnow())
            append_messages(session, agent, f"{agent}-c", _messages("secret plan", "ok"), f"r-{agent}", utcnow())
    with sessions() as session:
        continuing = [m.digest for m in _messages("secret plan", "ok", "and?")]
        assert find_by_content(session, "s-alice", continuing) is None
        found = find_by_content(session, "s-anon", continuing)
        assert found is not None and (found.agent_id, found.n_messages) == ("anon", 2)
