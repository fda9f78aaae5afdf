"""An agent moved on purpose: `semantic agents export` on one home, `import` on another,
served warm by another server, and damaged or foreign files refused with nothing written."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.archives import pack, unpack
from support.dbcheck import query
from test_cli import semantic

# Long enough for full 256-token blocks beside the record's private tail.
SYSTEM = "You are a terse assistant for a bakery. " + " ".join(
    f"Rule {i}: answer in one short sentence about bread, cakes, opening hours or prices." for i in range(20))
QUESTIONS = ["What bread sells best?", "How early do we open?", "What about cakes?"]
NEXT = [{"role": "user", "content": "Should we sell coffee?"}]


def _turn(api: httpx.Client, agent_id: str, messages: list[dict]) -> dict:
    response = api.post(f"/v1/agents/{agent_id}/generate",
                        json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    """A second server on a home of its own (another machine, as far as files go)."""
    running = start_server(tmp_path_factory.mktemp("other-home"), smollm2_dir)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def exported(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    api = httpx.Client(base_url=server.url, timeout=120)
    assert api.post("/v1/agents", json={"id": "baker", "system_prompt": SYSTEM}).status_code == 201
    for question in QUESTIONS:
        _turn(api, "baker", [{"role": "user", "content": question}])
    path = tmp_path_factory.mktemp("export") / "baker.tar"
    result = semantic(server.home, "agents", "export", "baker", "-o", str(path))
    assert result.returncode == 0, result.stderr
    assert "1 conversation(s), 6 messages" in result.stderr
    with tarfile.open(path) as archive:
        assert any(name.startswith("blocks/") for name in archive.getnames())
    return path


def _files(home: Path) -> set[Path]:
    return {p for p in (home / "blocks").rglob("*") if p.is_file()}


def test_an_exported_agent_is_warm_on_another_server_and_answers_the_same(
        server: ServerProcess, other: ServerProcess, exported: Path) -> None:
    result = semantic(other.home, "agents", "import", str(exported))
    assert result.returncode == 0, result.stderr
    assert "imported agent 'baker': 1 conversation(s), 6 messages" in result.stdout

    there = httpx.Client(base_url=other.url, timeout=120)
    agent = there.get("/v1/agents/baker").json()
    assert agent["metadata"]["system_prompt"] == SYSTEM and agent["tier"] == "warm"
    history = there.get("/v1/agents/baker/history").json()["messages"]
    here = httpx.Client(base_url=server.url, timeout=120)
    original = here.get("/v1/agents/baker/history").json()["messages"]
    assert [(m["role"], m["content"]) for m in history] == [(m["role"], m["content"]) for m in original]

    # The same next turn on both servers: the same reuse (all of the previous turns, from the
    # moved cache: without it the other server reads nothing) and the same answer.
    moved = _turn(there, "baker", NEXT)
    stayed = _turn(here, "baker", NEXT)
    assert moved["usage"]["cache_read_input_tokens"] == stayed["usage"]["cache_read_input_tokens"] > 300
    assert moved["content"] == stayed["content"]
    rows = "SELECT id, reuse_reason FROM requests WHERE agent_id = 'baker' ORDER BY created_at"
    source, landed = query(server.db_path, rows), query(other.db_path, rows)
    assert len(landed) == len(source) > 1
    assert landed[:-1] == source[:-1]  # the agent's request rows travelled with it, their ids kept
    assert landed[-1][1] == "extend"  # and its next turn there reused the moved cache


def test_import_refuses_a_taken_id_and_takes_another(other: ServerProcess, exported: Path) -> None:
    semantic(other.home, "agents", "import", str(exported))  # baker, if the test above did not run
    again = semantic(other.home, "agents", "import", str(exported))
    assert again.returncode == 2 and "already exists" in again.stderr and "--as" in again.stderr
    copy = semantic(other.home, "agents", "import", str(exported), "--as", "baker-2")
    assert copy.returncode == 0, copy.stderr
    # This home never computed these blocks: each import keeps its own, private to its agent.
    assert "(0 new block files)" not in copy.stdout
    there = httpx.Client(base_url=other.url, timeout=120)
    assert _turn(there, "baker-2", NEXT)["usage"]["cache_read_input_tokens"] > 300
    bad = semantic(other.home, "agents", "import", str(exported), "--as", "trav/../x y")
    assert bad.returncode == 2 and "is not 1-128 letters" in bad.stderr


def test_an_archive_of_this_homes_own_blocks_shares_them(server: ServerProcess, exported: Path) -> None:
    """Imported where it was exported, every block is this home's own, byte for byte: no new file."""
    back = semantic(server.home, "agents", "import", str(exported), "--as", "baker-back")
    assert back.returncode == 0, back.stderr
    assert "(0 new block files)" in back.stdout
    here = httpx.Client(base_url=server.url, timeout=120)
    assert _turn(here, "baker-back", NEXT)["usage"]["cache_read_input_tokens"] > 300


def _forged(source: Path, target: Path, scratch: Path) -> Path:
    """The archive with every block's KV data replaced by noise and every checksum recomputed
    (each file's own, the manifest's block checksums and its sha256 list): it verifies."""
    import numpy as np

    from app.cache import files

    manifest, members = unpack(source)
    rng = np.random.default_rng(1)
    checksums = {}
    for name in [n for n in members if n.startswith("blocks/")]:
        (scratch / "in.safetensors").write_bytes(members[name])
        arrays, meta = files.read(scratch / "in.safetensors")
        noise = {k: rng.integers(0, 255, a.shape).astype(a.dtype) if a.dtype.kind in "ui"
                 else (rng.standard_normal(a.shape) * 4).astype(a.dtype) for k, a in arrays.items()}
        checksums[meta["hash"]], _ = files.write(scratch / "out.safetensors", noise, meta)
        members[name] = (scratch / "out.safetensors").read_bytes()
    for conversation in manifest["conversations"]:
        for cache in conversation["caches"]:
            for block in cache["blocks"]:
                block["checksum"] = checksums[block["hash"]]
    return pack(target, manifest, members)


def test_a_forged_archive_serves_its_own_agent_and_no_other(
        other: ServerProcess, exported: Path, tmp_path: Path) -> None:
    """Round 4, item 1: an archive whose KV data is forged with every checksum recomputed is
    imported; another agent with the same system prompt reads nothing from it."""
    forged = _forged(exported, tmp_path / "forged.tar", tmp_path)
    result = semantic(other.home, "agents", "import", str(forged), "--as", "forger")
    assert result.returncode == 0, result.stderr
    there = httpx.Client(base_url=other.url, timeout=120)
    assert _turn(there, "forger", NEXT)["usage"]["cache_read_input_tokens"] > 300  # its own agent's, as it asked

    reply = there.post("/v1/chat/completions", json={
        "model": "smollm2-135m-instruct", "session_id": "neighbour", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Today's code served it the forged blocks: "shared", 256 tokens.
    assert query(other.db_path, "SELECT reuse_reason FROM requests WHERE agent_id = 'neighbour'") == [("miss",)]


def test_forged_digests_never_capture_a_request_that_names_no_agent(other: ServerProcess, exported: Path,
                                                                    tmp_path: Path) -> None:
    """Round 4, item 10: an archive claiming a content-recognised agent whose first message's
    digest is another client's (recomputed from a probe: the server's own digests of it) is
    imported; that client's next request, which names no agent, starts its own agent (before:
    it continued the archive's conversation, and read the archive's cache)."""
    question = {"model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the secret of good sourdough?"}]}
    there = httpx.Client(base_url=other.url, timeout=120)
    assert there.post("/v1/chat/completions", json={**question, "session_id": "probe"}).status_code == 200
    [(system_digest, first_digest)] = query(other.db_path, (
        "SELECT c.system_digest, m.digest FROM conversations c JOIN messages m ON m.conversation_id = c.id "
        "WHERE c.agent_id = 'probe' AND m.position = 0"))
    manifest, members = unpack(exported)
    manifest["agent"]["origin"] = "content"
    conversation = manifest["conversations"][0]
    conversation["system_digest"], conversation["messages"] = system_digest, conversation["messages"][:1]
    conversation["messages"][0]["digest"] = first_digest
    conversation["last_access_at"] = "2099-01-01T00:00:00"
    result = semantic(other.home, "agents", "import", str(pack(tmp_path / "digests.tar", manifest, members)),
                      "--as", "digest-forger")
    assert result.returncode == 0, result.stderr
    assert query(other.db_path, "SELECT origin FROM agents WHERE id = 'digest-forger'") == [("imported",)]

    reply = there.post("/v1/chat/completions", json=question)
    assert reply.status_code == 200, reply.text
    [(agent,)] = query(other.db_path, "SELECT agent_id FROM requests WHERE id = ?", reply.headers["request-id"])
    assert agent != "digest-forger"
    assert query(other.db_path, "SELECT count(*) FROM messages WHERE agent_id = 'digest-forger'") == [(1,)]


def test_a_refused_import_leaves_no_file(tmp_path: Path, exported: Path) -> None:
    """An archive that verifies but whose rows contradict each other (two messages at one
    position) is refused with a 2 and a line, after its files were written: none stays."""
    manifest, members = unpack(exported)
    messages = manifest["conversations"][0]["messages"]
    messages[1]["position"] = messages[0]["position"]
    home = tmp_path / "home"
    result = semantic(home, "agents", "import", str(pack(tmp_path / "twice.tar", manifest, members)))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "contradict" in result.stderr and "Traceback" not in result.stderr
    assert query(home / "semantic.db", "SELECT count(*) FROM agents") == [(0,)]
    assert _files(home) == set()


def _rewritten(source: Path, target: Path, change: Callable[[bytes], bytes], fix_manifest: bool) -> Path:
    """A copy of the archive with one member's bytes changed (and the manifest's sha256
    updated to match when ``fix_manifest``: then only the file's own checksum can tell)."""
    with tarfile.open(source) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
    manifest = json.loads(members["agent.json"])
    name = next(n for n in members if n.startswith("blocks/"))
    members[name] = change(members[name])
    if fix_manifest:
        manifest["files"][name] = hashlib.sha256(members[name]).hexdigest()
    members["agent.json"] = json.dumps(manifest).encode()
    with tarfile.open(target, "w") as archive:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return target


def _flip(data: bytes) -> bytes:
    at = len(data) - 10  # in the arrays, past the header
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize("fix_manifest", [False, True], ids=["sha256", "checksum"])
def test_a_damaged_archive_is_refused_and_nothing_is_written(
        tmp_path: Path, exported: Path, fix_manifest: bool) -> None:
    home = tmp_path / "home"
    damaged = _rewritten(exported, tmp_path / "damaged.tar", _flip, fix_manifest)
    result = semantic(home, "agents", "import", str(damaged))
    assert result.returncode == 2, result.stdout
    assert ("sha256 mismatch" if not fix_manifest else "does not verify") in result.stderr
    assert query(home / "semantic.db", "SELECT count(*) FROM agents") == [(0,)]
    assert _files(home) == set()
    assert semantic(home, "agents", "import", str(exported)).returncode == 0  # the good one goes in
    assert query(home / "semantic.db", "SELECT count(*) FROM messages") == [(6,)]


def test_an_archive_naming_other_paths_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as archive:
        for name, data in [("agent.json", b"{}"), ("../outside.safetensors", b"x")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    result = semantic(tmp_path / "home", "agents", "import", str(evil))
    assert result.returncode == 2 and "unexpected member '../outside.safetensors'" in result.stderr
    assert not (tmp_path / "outside.safetensors").exists()
    missing = semantic(tmp_path / "home", "agents", "export", "nobody", "-o", str(tmp_path / "x.tar"))
    assert missing.returncode == 2 and "agent 'nobody' does not exist" in missing.stderr
    assert not (tmp_path / "x.tar").exists() and not (tmp_path / "x.tar.partial").exists()


def test_a_deeply_nested_agent_json_is_refused_in_one_line(tmp_path: Path) -> None:
    """Issue 59, item 10: it was a RecursionError traceback, not exit 2."""
    deep = tmp_path / "deep.tar"
    data = b"[" * 100_000 + b"]" * 100_000
    with tarfile.open(deep, "w") as archive:
        info = tarfile.TarInfo("agent.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    result = semantic(tmp_path / "home", "agents", "import", str(deep))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "agent.json is nested too deeply" in result.stderr


def _sparse_member(name: str, real_size: int) -> bytes:
    """A GNU sparse member (old format) of 512 stored bytes that reads back as ``real_size``
    bytes (zeros past them), built by hand: Python's tarfile reads such members, never writes them."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, 512
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:398] = b"%011o\0" % 0  # the map's one entry: 512 bytes at offset 0
    header[398:410] = b"%011o\0" % 512
    header[483:495] = b"%011o\0" % real_size  # the size the member claims to expand to
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + b"\0" * 512


def test_an_archive_with_a_sparse_or_oversized_member_is_refused_unread(tmp_path: Path) -> None:
    """A 2 KB tar whose member expands to 2 GiB as it is read (GNU sparse) is refused from its
    header, as is a member whose header claims more than the limit: nothing is read whole
    (before: the import read the 2 GiB, 4.2 GB of memory)."""
    from app.agents.portable import MAX_MEMBER_BYTES

    sparse = tmp_path / "sparse.tar"
    sparse.write_bytes(_sparse_member("blocks/big.safetensors", 2 << 30) + b"\0" * 1024)
    assert sparse.stat().st_size < 4096 and tarfile.open(sparse).getmembers()[0].size == 2 << 30
    result = semantic(tmp_path / "home", "agents", "import", str(sparse), timeout=60)
    assert result.returncode == 2 and "sparse or larger than" in result.stderr, result.stderr

    oversized = tmp_path / "oversized.tar"
    info = tarfile.TarInfo("records/0.safetensors")
    info.size = MAX_MEMBER_BYTES + 1
    oversized.write_bytes(info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024)  # the header alone
    result = semantic(tmp_path / "home", "agents", "import", str(oversized), timeout=60)
    assert result.returncode == 2 and "sparse or larger than" in result.stderr, result.stderr


def test_an_archive_with_a_foreign_origin_is_refused(tmp_path: Path, exported: Path) -> None:
    manifest, members = unpack(exported)
    manifest["agent"]["origin"] = "../../etc"
    home = tmp_path / "home"
    result = semantic(home, "agents", "import", str(pack(tmp_path / "origin.tar", manifest, members)))
    assert result.returncode == 2 and "origin '../../etc' is not one of" in result.stderr, result.stderr
    assert query(home / "semantic.db", "SELECT count(*) FROM agents") == [(0,)]


def test_a_moved_responses_agent_continues_by_previous_response_id(
        server: ServerProcess, other: ServerProcess, tmp_path: Path) -> None:
    """The stored Responses objects travel with their agent: on the server it moved to, a
    client's next turn names its last response and continues it, warm (before: 404, the
    response stayed behind)."""
    here = httpx.Client(base_url=server.url, timeout=120)
    first = here.post("/v1/responses", json={"model": "gpt-5", "input": f"{SYSTEM} What bread sells best?",
                                             "max_output_tokens": 8, "temperature": 0})
    assert first.status_code == 200, first.text
    response_id = first.json()["id"]
    (agent_id,), = query(server.db_path, f"SELECT agent_id FROM responses WHERE id = '{response_id}'")
    archive = tmp_path / "responses-agent.tar"
    assert semantic(server.home, "agents", "export", agent_id, "-o", str(archive)).returncode == 0
    result = semantic(other.home, "agents", "import", str(archive))
    assert result.returncode == 0, result.stderr
    assert "1 stored responses" in result.stdout

    there = httpx.Client(base_url=other.url, timeout=120)
    assert there.get(f"/v1/responses/{response_id}").json()["id"] == response_id
    second = there.post("/v1/responses", json={"model": "gpt-5", "input": "And cakes?", "max_output_tokens": 8,
                                               "temperature": 0, "previous_response_id": response_id})
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 256  # the moved cache
    (continued,), = query(other.db_path, f"SELECT agent_id FROM responses WHERE id = '{second.json()['id']}'")
    assert continued == agent_id
