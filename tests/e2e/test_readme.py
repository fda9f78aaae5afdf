"""The copy-paste examples of the README and docs/, run as written against a freshly
started server.

Every ``sh`` block that talks to ``http://127.0.0.1:8000`` runs with bash
(``curl`` failing on HTTP errors), every ``python`` block that does runs with
this interpreter (the README first, then docs/ in name order), and the
``semantic sql`` examples run against the server's database afterwards. Only the
address is changed. The pages' mechanical claims (size, links, commands, settings,
layers) are checked without a server in tests/unit/test_docs.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import ROOT
from support.servers import ServerProcess, start_server, stop_server

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_BLOCKS = re.findall(r"```(sh|python)\n(.*?)```", PAGES[0].read_text(), re.DOTALL)
BLOCKS = [block for page in PAGES for block in re.findall(r"```(sh|python)\n(.*?)```", page.read_text(), re.DOTALL)]
ADDRESS = "http://127.0.0.1:8000"
API_BLOCKS = [(lang, code) for lang, code in BLOCKS
              if ADDRESS in code and "claude -" not in code and "./scripts/" not in code]
SQL_BLOCKS = [code for lang, code in BLOCKS if lang == "sh" and "semantic sql" in code]


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    running = start_server(tmp_path_factory.mktemp("readme-home"), smollm2_dir)
    yield running
    stop_server(running)


def run(lang: str, code: str, server: ServerProcess) -> subprocess.CompletedProcess[str]:
    code = code.replace(ADDRESS, server.url)
    if lang == "sh":
        code = code.replace("curl -s", "curl --fail-with-body -s")
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_readme_has_examples_for_every_user() -> None:
    joined = "\n".join(code for _, code in API_BLOCKS)
    for endpoint in ("/v1/messages", "/v1/chat/completions", "/v1/responses", "/v1/agents", "/health", "/metrics"):
        assert endpoint in joined
    assert any(lang == "python" for lang, _ in API_BLOCKS) and SQL_BLOCKS
    # The front door itself: a request to try, the SDKs, a question to the history.
    front = "\n".join(code for _, code in README_BLOCKS)
    assert ADDRESS + "/v1/messages" in front and "semantic sql" in front
    assert any(lang == "python" and ADDRESS in code for lang, code in README_BLOCKS)


def test_api_examples_run_against_a_fresh_server(fresh_server: ServerProcess) -> None:
    for lang, code in API_BLOCKS:
        done = run(lang, code, fresh_server)
        assert done.returncode == 0, f"{code}\nstdout: {done.stdout}\nstderr: {done.stderr}"
        assert done.stdout.strip(), code


def test_the_readmes_first_request_answers_right_as_written(fresh_server: ServerProcess) -> None:
    """The request a new user tries first gets the right answer every time (it once got
    nonsense 3 times in 4: no temperature, so the default 1.0)."""
    lang, first = next((lang, code) for lang, code in README_BLOCKS if ADDRESS + "/v1/messages" in code)
    for _ in range(3):
        done = run(lang, first, fresh_server)
        assert done.returncode == 0 and "Paris" in done.stdout, done.stdout


def test_sql_and_job_examples_run_on_what_the_examples_stored(fresh_server: ServerProcess) -> None:
    outputs = []
    for code in SQL_BLOCKS:
        code = code.replace(".venv/bin/semantic", f"{sys.executable} -m app")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env={"PATH": "/usr/bin:/bin", "SEMANTIC_HOME": str(fresh_server.home)})
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    # The agents the API examples created are in the turns view.
    assert any("my-app-1" in out and "weather-1" in out for out in outputs), outputs


LAUNCH_LINES = sorted({line.strip() for page in PAGES
                       for line in re.findall(r"`(\.venv/bin/semantic launch [^`]+)`", page.read_text())
                       + re.findall(r"^(semantic launch .+)$", page.read_text(), re.MULTILINE)})


def test_the_launch_lines_of_the_docs_run_as_written(fresh_server: ServerProcess, tmp_path: Path) -> None:
    """`semantic launch claude -- -p "say hello"` as the README writes it: argparse dropped
    a `--` right after the client's name and refused the client's arguments (issue 62; the
    tests passed `--bin` first, which hid it). Each line runs against the fresh server with a
    stand-in `claude` and `codex` on the PATH that record what they were given."""
    import shlex

    assert any(line.startswith(".venv/bin/semantic launch claude -- ") for line in LAUNCH_LINES), LAUNCH_LINES
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for client in ("claude", "codex"):
        stand_in = bin_dir / client
        stand_in.write_text(f'#!/bin/sh\nprintf "%s\\n" "$ANTHROPIC_BASE_URL" "$CLAUDE_CODE_MAX_OUTPUT_TOKENS" "$@" '
                            f'> "{tmp_path}/{client}.args"\n')
        stand_in.chmod(0o755)
    port = fresh_server.url.rsplit(":", 1)[1]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SEMANTIC_HOME": str(fresh_server.home), "SEMANTIC_PORT": port}
    for line in LAUNCH_LINES:
        command = f"{sys.executable} -m app " + line.split(" ", 1)[1]  # after .venv/bin/semantic or semantic
        words = shlex.split(line)
        client = words[words.index("launch") + 1]
        recorded = tmp_path / f"{client}.args"
        recorded.unlink(missing_ok=True)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        if "--print" in words:
            assert client in done.stdout and not recorded.exists(), line  # shown, not run
            continue
        given = recorded.read_text().splitlines()
        assert given[2:] == words[words.index("--") + 1:], (line, given)  # the client's own arguments
        if client == "claude":  # the server, and a reply budget for its 8K context (a 16th)
            assert given[:2] == [fresh_server.url.rstrip("/"), "512"], given
