"""Faults on a real server with several agents: the worker's jobs running in a loop
beside it, and random SIGKILLs with restarts. After each, the store's invariants hold
(``support.store_check``) and no turn a client saw finish is missing from the history."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path

import anthropic
import httpx

from app.store.db import make_engine, make_session_factory
from app.clock import utcnow
from app.cache.upkeep import run_compact, run_evict, run_expire
from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query
from support.store_check import store_problems

SYSTEM = "You are a helpful assistant for a travel agency. Answer in one short sentence. " * 30  # > 1 block
AGENTS = ("ann", "bob", "cid")
GREEDY = {"temperature": 0}


def ask(server: ServerProcess, agent: str, messages: list[dict[str, str]]) -> str:
    client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120)
    reply = client.messages.create(model="m", max_tokens=8, system=SYSTEM, extra_body=GREEDY, messages=messages,
                                   extra_headers={"x-session-id": agent})
    return reply.content[0].text


def next_turn(messages: list[dict[str, str]], n: int) -> list[dict[str, str]]:
    return [*messages, {"role": "user", "content": f"Suggest destination number {n} for a weekend trip."}]


def stored_replies(db: Path, agent: str) -> list[str]:
    """The agent's stored assistant messages, as text."""
    rows = query(db, "SELECT content FROM messages WHERE agent_id = ? AND role = 'assistant' ORDER BY id", agent)
    texts = []
    for (content,) in rows:
        value = json.loads(content)
        texts.append(value if isinstance(value, str) else "".join(b.get("text", "") for b in value))
    return texts


def test_the_worker_in_a_loop_beside_a_serving_server_breaks_nothing(tmp_path: Path, smollm2_dir: Path) -> None:
    """expire (TTL 0), evict (budget 0) and compact run back to back while three agents take
    turns: every turn answers, every turn's history is stored, the store stays consistent."""
    home = tmp_path / "home"
    server = start_server(home, smollm2_dir)
    sessions = make_session_factory(make_engine(f"sqlite:///{home / 'semantic.db'}"))
    stop = threading.Event()
    runs: list[str] = []

    def worker() -> None:
        while not stop.is_set():
            run_expire(sessions, 0, now=utcnow() + timedelta(seconds=1))
            run_evict(sessions, 0)
            run_compact(sessions.kw["bind"], sessions, home / "blocks")
            runs.append("all")

    try:
        with ThreadPoolExecutor(1) as jobs:
            looping = jobs.submit(worker)

            def converse(agent: str) -> list[str]:
                messages: list[dict[str, str]] = []
                replies = []
                for n in range(3):
                    messages = next_turn(messages, n)
                    replies.append(ask(server, agent, messages))
                    messages.append({"role": "assistant", "content": replies[-1]})
                return replies

            with ThreadPoolExecutor(len(AGENTS)) as pool:
                replies = dict(zip(AGENTS, pool.map(converse, AGENTS)))
            stop.set()
            looping.result(timeout=120)
        assert len(runs) >= 2
        assert query(home / "semantic.db", "SELECT count(*) FROM job_runs WHERE status != 'ok'") == [(0,)]
        for agent in AGENTS:
            assert stored_replies(home / "semantic.db", agent) == replies[agent], agent
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    finally:
        stop.set()
        stop_server(server)
    assert store_problems(home) == []


def test_random_kills_lose_no_finished_turn_and_leave_a_consistent_store(tmp_path: Path, smollm2_dir: Path) -> None:
    """Three agents converse; the server is SIGKILLed at a random moment of each round and
    restarted. Turns cut by a kill are asked again; every answered turn stays stored."""
    rng = random.Random(7)
    home = tmp_path / "home"
    server = start_server(home, smollm2_dir)
    conversations: dict[str, list[dict[str, str]]] = {agent: [] for agent in AGENTS}
    answered: dict[str, list[str]] = {agent: [] for agent in AGENTS}
    try:
        for round_ in range(4):
            pending = {agent: next_turn(conversations[agent], len(answered[agent])) for agent in AGENTS}

            def attempt(agent: str) -> str | None:
                try:
                    return ask(server, agent, pending[agent])
                except (anthropic.APIConnectionError, anthropic.InternalServerError):
                    return None  # cut by the kill

            with ThreadPoolExecutor(len(AGENTS)) as pool:
                futures = {agent: pool.submit(attempt, agent) for agent in AGENTS}
                # At a random moment once a first turn is answered: the others are prefilling,
                # decoding or being written to disk.
                wait(futures.values(), timeout=120, return_when=FIRST_COMPLETED)
                time.sleep(rng.uniform(0.0, 1.5))
                os.kill(server.process.pid, signal.SIGKILL)
                server.process.wait()
                results = {agent: future.result(timeout=120) for agent, future in futures.items()}
            for agent, reply in results.items():
                if reply is not None:
                    answered[agent].append(reply)
                    conversations[agent] = [*pending[agent], {"role": "assistant", "content": reply}]
            assert store_problems(home) == [], f"after kill {round_}"
            for agent in AGENTS:
                stored = stored_replies(home / "semantic.db", agent)
                assert all(reply in stored for reply in answered[agent]), (agent, round_)
            server = start_server(home, smollm2_dir)
            # The start marks what the killed process left running (issue 59, item 9).
            assert query(home / "semantic.db", "SELECT count(*) FROM requests WHERE status = 'running'") == [(0,)]
        for agent in AGENTS:  # a last turn each, uninterrupted
            reply = ask(server, agent, next_turn(conversations[agent], len(answered[agent])))
            assert reply in stored_replies(home / "semantic.db", agent)
    finally:
        stop_server(server)
    assert store_problems(home) == []
    assert sum(map(len, answered.values())) >= 4  # at least one turn a round finished before its kill
    (interrupted,), = query(home / "semantic.db", "SELECT count(*) FROM requests WHERE status = 'interrupted'")
    assert interrupted >= 1 and "marked interrupted" in "".join(
        p.read_text() for p in home.glob("server.log*")), "no kill cut a request in flight"
