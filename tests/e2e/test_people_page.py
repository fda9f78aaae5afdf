"""The people page (/agents) in a real headless Chromium driven by chromedriver, on a real server:
it lists an agent made through the API, shows its turns and caches, continues its conversation
from the box and shows what was read from cache; history is shown as text, never as markup;
with an api_key set it works once the key is entered, and nothing reads the API without it.
It is a place to talk: it creates an agent, streams a reply, stops a generation, starts a new
conversation, deletes the agent, renders Markdown as elements it builds, and its layout holds
from 800 to 1920 px wide (screenshots under the test's tmp dir)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
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
    assert conversation["last_hit"]["cached_tokens"] == second["usage"]["cache_read_input_tokens"]

    shown = open_agent(browser, server.url, agent)
    for text in ("Name a fruit.", reply_text(first), "Name a vegetable.", reply_text(second)):
        assert text in shown, (text, shown)
    # The cache as the page read it: the engine publishes the hot cache's size just after the answer.
    cache = httpx.get(f"{server.url}/v1/agents/{agent}").json()["conversations"][0]["caches"][0]
    caches = browser.text("details.conversation[open] table.caches")
    assert f"{cache['model']} {cache['tier']} {cache['cached_tokens']}" in caches, caches  # model, tier, tokens
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


def wait_hidden(browser: Browser, css: str, hidden: bool = True) -> None:
    browser.wait(lambda: browser.run("return document.querySelector(arguments[0]).hidden === arguments[1]", css, hidden),
                 f"{css} hidden={hidden}")


def history_of(server: ServerProcess, agent: str) -> list[dict[str, Any]]:
    return httpx.get(f"{server.url}/v1/agents/{agent}/history").json()["messages"]


def test_a_new_agent_from_the_page_a_streamed_reply_a_new_conversation_and_delete(server: ServerProcess,
                                                                                  browser: Browser) -> None:
    agent = "people-page-made"
    model = httpx.get(f"{server.url}/health").json()["model"]
    browser.open(f"{server.url}/agents")
    browser.wait(lambda: browser.run("return document.getElementById('model').options.length"), "the model list")
    served = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    options = browser.run("return [...document.getElementById('model').options].map((o) => [o.value, o.selected])")
    assert [value for value, _ in options] == served and sum(selected for _, selected in options) == 1
    browser.type("#new-id", agent)
    browser.type("#new-system", "You are brief.")
    browser.click("#create-button")
    browser.wait_text("#agent-title", agent)
    assert "You are brief." in browser.text("#agent-facts") and agent in browser.text("#agents")
    assert httpx.get(f"{server.url}/v1/agents/{agent}").json()["metadata"]["system_prompt"] == "You are brief."

    # Every delta replaces the reply's rendering: more than one change is a reply that streamed in.
    browser.run("window.changes = 0; new MutationObserver(() => window.changes++)"
                ".observe(document.getElementById('reply-body'), {childList: true});")
    browser.type("#message", "Name three fruits.")
    browser.type("#max-tokens", "12")
    browser.click("#send-button")
    read = int(browser.wait(lambda: browser.text("#cache-read-tokens"), "the reply's cache count"))
    assert read > 0  # the system prompt was prefilled when the agent was made
    assert browser.run("return window.changes") >= 2
    stored = history_of(server, agent)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    reply = stored[1]["content"]
    reply_words = (reply if isinstance(reply, str) else "".join(b.get("text", "") for b in reply)).split()
    shown = browser.text("#reply-body")
    assert all(word.strip("*_`#") in shown for word in reply_words), (reply_words, shown)
    # The conversation was reloaded: its cache line names the model and tells the last hit.
    conversation = browser.wait_text("details.conversation[open]", "Name three fruits.", f"{read} of")
    assert model in browser.text("details.conversation[open] table.caches"), conversation

    browser.click("#new-conversation")
    browser.wait_text("#send-label", "Start a new conversation")
    browser.type("#message", "Name a colour.")
    browser.type("#max-tokens", "4")
    browser.click("#send-button")
    browser.wait(lambda: len(httpx.get(f"{server.url}/v1/agents/{agent}").json()["conversations"]) == 2
                 and browser.text("#cache-read-tokens"), "the second conversation")
    browser.wait_text("details.conversation[open]", "Name a colour.")
    assert "Name three fruits." not in browser.text("details.conversation[open]")
    assert browser.run("return document.getElementById('new-conversation').checked") is False

    browser.click("#delete-agent")
    browser.wait_text("#delete-agent", "Click again")
    assert httpx.get(f"{server.url}/v1/agents/{agent}").status_code == 200  # one click deletes nothing
    browser.click("#delete-agent")
    wait_hidden(browser, "#agent")
    assert httpx.get(f"{server.url}/v1/agents/{agent}").status_code == 404
    assert agent not in browser.text("#agents")
    assert page_errors(browser) == []


def test_stop_cancels_a_long_generation(server: ServerProcess, browser: Browser) -> None:
    agent = "people-page-stop"
    assert httpx.post(f"{server.url}/v1/agents", json={"id": agent}).status_code == 201
    browser.open(f"{server.url}/agents#{agent}")
    browser.wait_text("#agent-title", agent)
    browser.type("#message", "Count from 1 to 1000, one number per line.")
    browser.type("#max-tokens", "2000")
    browser.click("#send-button")
    wait_hidden(browser, "#stop-button", False)
    browser.wait(lambda: browser.text("#reply-body").strip(), "the first streamed text")
    browser.click("#stop-button")
    browser.wait_text("#cache-read", "Stopped")
    wait_hidden(browser, "#stop-button")
    assert browser.run("return document.getElementById('send-button').disabled") is False
    # The server cancelled it: nothing runs, and no turn was stored.
    browser.wait(lambda: httpx.get(f"{server.url}/health").json()["active_requests"] == 0, "the cancel", 60)
    assert history_of(server, agent) == []
    assert page_errors(browser) == []


MARKDOWN = ("Here is **bold**, *italic* and `x < y`.\n\n- one <script>window.pwned = 1</script>\n- two "
            "<img src=x onerror=\"window.pwned = 2\">\n\n1. first\n2. [a link](https://example.com/a) and "
            "[a trap](javascript:window.pwned=3)\n\n```python\nprint('<b>hi</b>')\n```")


def test_markdown_in_a_reply_is_elements_the_page_builds_never_markup(server: ServerProcess,
                                                                      browser: Browser) -> None:
    """An assistant turn with Markdown, a <script> and an <img> (stored through the direct API,
    as a model could write it): shown as paragraphs, lists, code and a safe link; the markup
    is text, and no script or image is made."""
    agent = "people-page-markdown"
    assert httpx.post(f"{server.url}/v1/agents", json={"id": agent, "prefill": False}).status_code == 201
    response = httpx.post(f"{server.url}/v1/agents/{agent}/generate", timeout=120, json={"messages": [
        {"role": "user", "content": "Show me Markdown."}, {"role": "assistant", "content": MARKDOWN},
        {"role": "user", "content": "Thanks."}], **SAMPLING})
    assert response.status_code == 200, response.text

    open_agent(browser, server.url, agent)
    box = "details.conversation[open] .message.assistant .markdown"
    browser.wait(lambda: browser.find(box), "the rendered Markdown")
    made = browser.run("""const box = document.querySelector(arguments[0]);
        return {strong: [...box.querySelectorAll('strong')].map((e) => e.textContent),
                em: [...box.querySelectorAll('em')].map((e) => e.textContent),
                code: [...box.querySelectorAll('p code')].map((e) => e.textContent),
                ul: [...box.querySelectorAll('ul > li')].map((e) => e.textContent),
                ol: [...box.querySelectorAll('ol > li')].length,
                pre: box.querySelector('pre code').textContent, lang: box.querySelector('pre code').dataset.lang,
                links: [...box.querySelectorAll('a')].map((a) => [a.textContent, a.href, a.rel, a.target]),
                unsafe: document.querySelectorAll('#conversations script, #conversations img, '
                                                  + '#conversations b').length};""", box)
    assert made["strong"] == ["bold"] and made["em"] == ["italic"] and made["code"] == ["x < y"]
    assert made["ul"] == ["one <script>window.pwned = 1</script>", 'two <img src=x onerror="window.pwned = 2">']
    assert made["ol"] == 2 and made["pre"] == "print('<b>hi</b>')" and made["lang"] == "python"
    assert made["links"] == [["a link", "https://example.com/a", "noopener noreferrer", "_blank"]]
    assert made["unsafe"] == 0
    assert "[a trap](javascript:window.pwned=3)" in browser.text(box)
    # The reply box renders with the same function: a streamed reply is built the same way.
    streamed = browser.run("""const node = markdown(arguments[0]);
        document.getElementById('reply-body').replaceChildren(node);
        return [node.querySelectorAll('script, img, b').length, node.querySelectorAll('a').length,
                node.querySelectorAll('li').length];""", MARKDOWN)
    assert streamed == [0, 1, 4]
    assert browser.run("return window.pwned === undefined") is True
    assert page_errors(browser) == []


def test_a_turn_the_direct_api_refuses_is_shown_and_a_new_conversation_works(server: ServerProcess,
                                                                             browser: Browser) -> None:
    """An agent whose latest conversation came through the Anthropic API: the box's turn is a
    400 naming that API, shown next to the box; a new conversation of the agent works."""
    agent = "people-page-foreign"
    made = httpx.post(f"{server.url}/v1/messages", headers={"x-session-id": agent}, timeout=120,
                      json={"model": "m", **SAMPLING, "messages": [{"role": "user", "content": "Say hi."}]})
    assert made.status_code == 200, made.text
    open_agent(browser, server.url, agent)
    browser.type("#message", "Again.")
    browser.type("#max-tokens", "4")
    browser.click("#send-button")
    error = browser.wait_text("#send-error", "anthropic API")
    assert "continue it through that API" in error
    assert len(history_of(server, agent)) == 2
    browser.click("#new-conversation")
    browser.click("#send-button")
    browser.wait(lambda: browser.text("#cache-read-tokens"), "the new conversation's reply")
    wait_hidden(browser, "#send-error")
    assert len(httpx.get(f"{server.url}/v1/agents/{agent}").json()["conversations"]) == 2


@pytest.mark.parametrize("width", [800, 1280, 1920])
def test_the_layout_holds_from_800_to_1920_px(server: ServerProcess, browser: Browser, tmp_path: Path,
                                              width: int) -> None:
    """No horizontal scrolling, the agent list and the detail pane side by side (or stacked)
    without overlapping, the list's table inside its pane, and nothing squeezed to nothing."""
    agent = "people-page-layout-with-a-rather-long-agent-id-that-must-wrap"
    if httpx.get(f"{server.url}/v1/agents/{agent}").status_code == 404:
        assert httpx.post(f"{server.url}/v1/agents", json={"id": agent, "prefill": False}).status_code == 201
        generate(server, agent, "Name a fruit.")
    browser.resize(width, 900)
    open_agent(browser, server.url, agent)
    shot = browser.screenshot(tmp_path / f"agents-{width}.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    seen = browser.run("""const rect = (css) => document.querySelector(css).getBoundingClientRect().toJSON();
        return {inner: innerWidth, scroll: document.documentElement.scrollWidth,
                rects: Object.fromEntries(['#list', '#agent', '#agents', '#new-agent', '#conversations', '#send',
                                           '#message', '#send-button', '#model', 'details.conversation[open]']
                                          .map((css) => [css, rect(css)]))};""")
    assert abs(seen["inner"] - width) <= 20, seen["inner"]  # the window is the asked size
    assert seen["scroll"] <= seen["inner"], seen
    rects = seen["rects"]
    assert all(r["width"] > 0 and r["height"] > 0 for r in rects.values()), rects
    pane, listing = rects["#agent"], rects["#list"]
    apart = (listing["right"] <= pane["left"] or pane["right"] <= listing["left"]
             or listing["bottom"] <= pane["top"] or pane["bottom"] <= listing["top"])
    assert apart, (listing, pane)
    assert (listing["right"] <= pane["left"]) == (width >= 960)  # side by side from 960 px, else stacked
    assert rects["#agents"]["right"] <= listing["right"] + 0.5 and rects["#agents"]["left"] >= listing["left"] - 0.5
    for inside in ("#conversations", "#send", "details.conversation[open]"):
        assert rects[inside]["right"] <= pane["right"] + 0.5, (inside, rects[inside], pane)
    assert page_errors(browser) == []
