"""The operator page, rendered by a real headless Chromium: it shows an agent created here, its
conversation, and a cache miss with its reason; the screenshot is a real, non-blank page."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from PIL import Image

from support.servers import ServerProcess
from support.webdriver import CHROMIUM_FLAGS


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium")
    assert binary, "Chromium is required for the operator page test (scripts/test installs it)"
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def populated(server: ServerProcess) -> str:
    agent = "status-page-agent"
    assert httpx.post(f"{server.url}/v1/agents", json={"id": agent, "prefill": False}).status_code == 201
    for question in ("Name a fruit.", "Name a vegetable."):  # two conversations: the second is a miss
        response = httpx.post(f"{server.url}/v1/agents/{agent}/generate", timeout=120, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200
    httpx.post(f"{server.url}/v1/messages", timeout=120, headers={"x-session-id": agent}, json={
        "model": "m", "max_tokens": 4, "temperature": 0, "system": "Another system prompt.",
        "messages": [{"role": "user", "content": "Hello"}]})
    return agent


def test_the_page_shows_the_agent_in_a_real_browser(server: ServerProcess, populated: str, tmp_path: Path) -> None:
    url = f"{server.url}/status"
    assert httpx.get(url).headers["content-type"].startswith("text/html")
    dom = chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert f"<td>{populated}</td>" in dom.stdout  # the agents table, as the browser built it
    assert "Latest cache misses" in dom.stdout and "<script" not in dom.stdout
    assert dom.stdout.count("conv_") >= 2  # its conversations are listed
    shot = tmp_path / "status.png"
    done = chromium(tmp_path, f"--screenshot={shot}", url)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 900)
    histogram = image.histogram()
    dark = sum(histogram[:100])  # text
    light = sum(histogram[200:])  # background
    assert dark > 2000 and light > 0.5 * image.size[0] * image.size[1], (dark, light)


def test_the_page_escapes_what_clients_sent(server: ServerProcess, tmp_path: Path) -> None:
    """Two conversations whose system prompts part inside a script tag: the miss's excerpts,
    shown on the page, are escaped."""
    for n in (1, 2):
        response = httpx.post(f"{server.url}/v1/messages", timeout=120, headers={"x-session-id": "escape-check"},
                              json={"model": "m", "max_tokens": 2, "system": f"Be <script>alert({n})</script> brief.",
                                    "messages": [{"role": "user", "content": "<img src=x onerror=alert(1)>"}]})
        assert response.status_code == 200
    page = httpx.get(f"{server.url}/status").text
    assert "<script>" not in page and "&lt;script&gt;alert(" in page
