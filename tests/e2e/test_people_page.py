"""The people page (/agents) in a real headless Chromium driven by chromedriver, on a real server:
it lists an agent made through the API, shows its turns and caches, continues its conversation
from the box and shows what was read from cache; history is shown as text, never as markup;
with an api_key set it works once the key is entered, and nothing reads the API without it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import ServerProcess, start_server, stop_server
from support.webdriver import Browser

KEY = "sk-people-page-key"
SAMPLING = {"max_tokens": 8, "temperature": 0}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    running = Browser(tmp_path / "profile")
    yield running
    running.close()


def generate(server: ServerProcess, agent: str, text: str, **headers: str) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/agents/{agent}/generate", headers=headers, timeout=120,
                          json={"messages": [{"role": "user", "content": text}], **SAMPLING})
    assert response.status_code == 200, response.text
    return response.json()


def reply_text(reply: dict[str, Any]) -> str:
    return "".join(block["text"] for block in reply["content"] if block["type"] == "text").strip()


def page_errors(browser: Browser) -> list[str]:
    """Console errors (a script error, a refused request, a content-security-policy violation)."""
    return [m["message"] for m in browser.console() if m["level"] == "SEVERE" and "favicon.ico" not in m["message"]]


def open_agent(browser: Browser, url: str, agent: str) -> str:
    """Open the page, click the agent in the list; the open conversation's text."""
    browser.open(f"{url}/agents")
    browser.click(f'#agents a[href="#{agent}"]')
    browser.wait_text("#agent-title", agent)
    return browser.wait_text("details.conversation[open]", "the box below continues this one")


def test_an_agent_s_turns_and_caches_and_a_third_turn_from_the_box(server: ServerProcess, browser: Browser) -> None:
    agent = "people-page-agent"
    created = httpx.post(f"{server.url}/v1/agents", json={"id": agent, "system_prompt": "You are brief."})
    assert created.status_code == 201, created.text
    first = generate(server, agent, "Name a fruit.")
    second = generate(server, agent, "Name a vegetable.")
    assert second["usage"]["cache_read_input_tokens"] > 0
    status = httpx.get(f"{server.url}/v1/agents/{agent}").json()
    conversation = status["conversations"][0]
    cache = conversation["caches"][0]
    assert conversation["last_hit"]["cached_tokens"] == second["usage"]["cache_read_input_tokens"]

    shown = open_agent(browser, server.url, agent)
    for text in ("Name a fruit.", reply_text(first), "Name a vegetable.", reply_text(second)):
        assert text in shown, (text, shown)
    caches = browser.text("details.conversation[open] table.caches")
    assert f"{cache['tier']} {cache['cached_tokens']}" in caches, caches  # a row: model, tier, cached tokens
    assert f"{second['usage']['cache_read_input_tokens']} of" in shown  # the last hit
    assert agent in browser.text("#agents") and "You are brief." in browser.text("#agent-facts")

    browser.type("#message", "Name a colour.")
    browser.type("#max-tokens", str(SAMPLING["max_tokens"]))
    browser.type("#temperature", str(SAMPLING["temperature"]))
    browser.click("#send-button")
    read = int(browser.wait(lambda: browser.text("#cache-read-tokens"), "the reply's cache count"))
    assert read > 0
    assert f"read from cache: {read} of " in browser.text("#cache-read")
    history = httpx.get(f"{server.url}/v1/agents/{agent}/history").json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"] * 3
    assert history[4]["content"] == "Name a colour."
    third = history[5]["content"]
    third_text = third if isinstance(third, str) else "".join(b.get("text", "") for b in third)
    assert third_text.strip() in browser.text("#reply-body")
    # The conversation was reloaded: the third turn is in it, and its last hit is the new one.
    browser.wait_text("details.conversation[open]", "Name a colour.", third_text.strip(), f"{read} of")
    assert page_errors(browser) == []


def test_history_is_shown_as_text_and_tool_calls_readably(server: ServerProcess, browser: Browser) -> None:
    """Markup in messages, tool inputs and tool results is text on the page: no element is
    made from it and no script of it runs."""
    agent = "people-page-markup"
    body = {"model": "m", **SAMPLING, "system": "Use tools.",
            "tools": [{"name": "get_weather", "description": "The weather in a city.",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "messages": [
                {"role": "user", "content": "Weather in <script>window.pwned = 1</script> Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "<b>Paris</b>"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "Sunny <img src=x onerror=\"window.pwned = 2\">"}]}]}
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-session-id": agent}, json=body, timeout=120)
    assert response.status_code == 200, response.text

    shown = open_agent(browser, server.url, agent)
    assert "Weather in <script>window.pwned = 1</script> Paris?" in shown
    assert "tool call: get_weather (toolu_1)" in shown and '"city": "<b>Paris</b>"' in shown
    assert "tool result for toolu_1" in shown and 'Sunny <img src=x onerror="window.pwned = 2">' in shown
    made = browser.run("return document.querySelectorAll('#conversations script, #conversations img, "
                       "#conversations b').length")
    assert made == 0
    assert browser.run("return window.pwned === undefined") is True
    assert page_errors(browser) == []


def test_the_page_files_hold_no_data_and_forbid_inline_scripts(server: ServerProcess) -> None:
    page = httpx.get(f"{server.url}/agents")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert "people-page" not in page.text and "<script>" not in page.text  # no data, no inline script
    for asset in ("/agents/page.js", "/agents/page.css"):
        assert httpx.get(f"{server.url}{asset}").status_code == 200
    script = httpx.get(f"{server.url}/agents/page.js").text
    assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write", script)  # text nodes only
    assert 'href="/agents"' in httpx.get(f"{server.url}/", headers={"accept": "text/html"}).text
    assert 'href="/agents"' in httpx.get(f"{server.url}/status").text


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("people-locked"), smollm2_dir, {"SEMANTIC_API_KEY": KEY})
    yield server
    stop_server(server)


def test_with_an_api_key_the_page_asks_for_it_and_nothing_reads_without_it(locked: ServerProcess,
                                                                            browser: Browser) -> None:
    agent = "people-page-locked"
    key = {"x-api-key": KEY}
    assert httpx.post(f"{locked.url}/v1/agents", json={"id": agent, "prefill": False}, headers=key).status_code == 201
    generate(locked, agent, "Say hello.", **key)
    for method, path in (("GET", "/v1/agents"), ("GET", f"/v1/agents/{agent}"), ("GET", f"/v1/agents/{agent}/history"),
                         ("POST", f"/v1/agents/{agent}/generate")):
        refused = httpx.request(method, f"{locked.url}{path}", json={"messages": [
            {"role": "user", "content": "hi"}], **SAMPLING} if method == "POST" else None)
        assert refused.status_code == 401, (method, path, refused.text)
    # The key does not make a cross-site request acceptable: a foreign page is still refused.
    foreign = httpx.post(f"{locked.url}/v1/agents/{agent}/generate", headers={**key, "origin": "https://evil.example"},
                         json={"messages": [{"role": "user", "content": "hi"}], **SAMPLING})
    assert foreign.status_code == 403
    assert len(httpx.get(f"{locked.url}/v1/agents/{agent}/history", headers=key).json()["messages"]) == 2

    browser.open(f"{locked.url}/agents")
    browser.wait(lambda: browser.run("return !document.getElementById('key-form').hidden"), "the key form")
    assert agent not in browser.text("#agents")
    browser.type("#key", "a-wrong-key")
    browser.click("#key-form button")
    browser.wait_text("#error", "That key was refused")
    browser.type("#key", KEY)
    browser.click("#key-form button")
    shown = open_agent(browser, locked.url, agent)  # a reload: the key stays in this tab's session storage
    assert "Say hello." in shown
    assert browser.run("return [sessionStorage.length, localStorage.length]") == [1, 0]
    browser.type("#message", "Say goodbye.")
    browser.type("#max-tokens", "4")
    browser.click("#send-button")
    assert int(browser.wait(lambda: browser.text("#cache-read-tokens"), "the reply's cache count")) > 0
    assert len(httpx.get(f"{locked.url}/v1/agents/{agent}/history", headers=key).json()["messages"]) == 4
    browser.click("#forget-key")
    browser.wait(lambda: browser.run("return !document.getElementById('key-form').hidden"), "the key form again")
    assert all("status of 401" in e for e in page_errors(browser))  # the refused calls, nothing else
