"""A pool over several hosts, each a Linux network namespace with its own address on one
bridge (tests/support/pool_hosts.py on tests/support/netns.py): PostgreSQL, the S3 tier
(SeaweedFS) and the worker on ``store``, HAProxy on ``router`` (``semantic pool
router-config``, its runtime API over TCP), a server on ``h1`` and ``h2`` (``semantic
serve --host 0.0.0.0``), every part reaching the others by address, never loopback: what
docs/pool.md's "Several machines" runs. A server partitioned from the database answers 503
with retry-after; a whole host killed (every process of its namespace, its link cut) and
its agents continue warm on the other from the tier, ownership moving forward; a third
host joins the running router with ``semantic pool join --router`` and serves new agents,
then drains with ``semantic pool drain --router``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.pool_hosts import KEY, PoolHosts, missing
from test_pool import SYSTEM, prompt_tokens, stored_messages, wait_uploaded

from app.pool.haproxy import RuntimeAPI


def ask(url: str, agent: str, history: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", timeout=120, headers={"x-claude-code-session-id": agent, "x-api-key": KEY},
                      json={"model": "claude-sonnet-5", "max_tokens": 8, "temperature": 0, "system": SYSTEM,
                            "messages": history})


def turn(url: str, agent: str, history: list[dict]) -> tuple[str, str, dict]:
    """One greedy turn of ``agent``: (the server that answered, the reply, its usage)."""
    response = ask(url, agent, history)
    assert response.status_code == 200, response.text
    body = response.json()
    return response.headers["x-semantic-server"], body["content"][0]["text"], body["usage"]


def test_a_pool_over_hosts_survives_a_host_and_takes_one_joining(tmp_path: Path, smollm2_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    with PoolHosts(tmp_path, smollm2_dir, ["h1", "h2"], later=["h3"]) as pool:
        address, router, admin = pool.address, pool.router, pool.admin
        assert f"stats socket ipv4@{admin} level admin" in pool.router_config
        for name, value in pool.credentials.items():  # to read the tier from here
            monkeypatch.setenv(name, value)
        state = {"database_url": pool.database_url, "block_store": pool.block_store}

        # Agents stay on their server.
        histories: dict[str, list[dict]] = {f"agent-{i}": [] for i in range(4)}
        placed: dict[str, set[str]] = {agent: set() for agent in histories}
        prompts: dict[str, int] = {}

        def step(agent: str, content: str) -> tuple[str, dict]:
            history = histories.setdefault(agent, [])
            history.append({"role": "user", "content": f"{content} ({agent})"})
            server, reply, usage = turn(router, agent, history)
            history.append({"role": "assistant", "content": reply})
            placed.setdefault(agent, set()).add(server)
            prompts[agent] = prompt_tokens(usage)
            return server, usage

        for n in range(2):
            for agent in list(histories):
                step(agent, f"Question {n}: do you sell nails?")
        assert all(len(servers) == 1 for servers in placed.values()), placed
        assert {s for servers in placed.values() for s in servers} == {"h1", "h2"}, placed
        before = pool.owners()
        assert {agent: server for agent, (server, _) in before.items()} == \
            {agent: next(iter(servers)) for agent, servers in placed.items()}

        victim = "h1"
        moved = [agent for agent, servers in placed.items() if servers == {victim}]
        for agent in moved:
            wait_uploaded(state, agent, prompts[agent] - 1)

        # Partitioned from the database (and the tier), h1 serves nothing: 503, retry-after.
        pool.hosts.unreachable(victim, address["store"])
        agent = moved[0]
        refused = ask(pool.url(victim), agent, [*histories[agent], {"role": "user", "content": "Hello?"}])
        assert refused.status_code == 503, refused.text
        assert refused.elapsed.total_seconds() < 30  # its open connections fail too (tcp_user_timeout)
        assert refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["message"] == "the database is unavailable; retry shortly"

        # The whole host fails: every process of it killed, its link cut. Its agents go on on
        # h2, warm from the tier, and h2 owns them at a later epoch.
        pool.kill(victim)
        for agent in moved:
            previous = prompts[agent]
            server, usage = step(agent, "Still there?")
            assert server == "h2"
            assert usage["cache_read_input_tokens"] >= 0.9 * previous, (agent, usage, previous)
        after = pool.owners()
        for agent, (server, epoch) in after.items():
            assert epoch >= before[agent][1], (agent, before[agent], after[agent])
            if agent in moved:
                assert server == "h2" and epoch > before[agent][1], (agent, before[agent], after[agent])
            else:
                assert after[agent] == before[agent]

        # A third host joins the running router from its own host, and takes new agents.
        joined = pool.join("h3")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "server h3 joined" in joined.stdout
        state_of = RuntimeAPI(admin).command("show servers state servers")
        assert f" h3 {address['h3']} " in state_of, state_of
        newcomers = []
        for i in range(4):
            newcomers.append(f"new-{i}")
            if step(f"new-{i}", "Do you sell paint?")[0] == "h3":
                break
        assert placed[newcomers[-1]] == {"h3"}, {a: placed[a] for a in newcomers}

        # It drains from its own host: no new work, stopped (flushed, its agents released);
        # its agent's next turn runs on h2, warm from the tier.
        newcomer = newcomers[-1]
        drained = pool.drain("h3")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "server h3 drained" in drained.stdout
        assert pool.hosts.pids("h3") == []
        previous = prompts[newcomer]
        server, usage = step(newcomer, "Thanks.")
        assert server == "h2" and usage["cache_read_input_tokens"] >= 0.9 * previous, (server, usage, previous)
        final = pool.owners()
        assert all(final[agent][1] >= after.get(agent, ("", 0))[1] for agent in final)
        assert final[newcomer][0] == "h2"

        # Every turn, on every host, is in the database; the refused one is not.
        assert stored_messages(state) == {agent: len(history) for agent, history in histories.items()}
