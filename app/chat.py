"""`semantic chat [AGENT] [QUESTION]`: talk to the running server from a terminal.

A client of the direct agent API (docs/apis.md), over HTTP like any other: the agent keeps
its history and its cache on the server, so a chat picked up later (`semantic chat AGENT`
again, or the /agents page) continues warm. Each reply streams as it is generated and is
followed by one line: tokens read from cache out of the prompt, time to first token
(from sending the request), and decode speed. While a long prompt is prefilled, a
terminal shows how far it got (the stream's progress comments).

In a terminal, input has line editing and a history (readline, kept in
``$SEMANTIC_HOME/chat_history``); a paste of several lines is one turn (the terminal's
bracketed paste), and so is a block typed between lines of ``\"\"\"``. Nothing is cut:
readline reads past the terminal's 4,095-character line. Lines starting with ``/`` are
commands: ``/new [ID]`` starts a new agent, ``/agents`` lists the server's agents,
``/help``, ``/quit`` (or Ctrl-D). Ctrl-C during a reply stops it (the server records it
as cancelled); at the prompt it leaves. With a question (``semantic chat "question"``, as
``ollama run`` does), it answers once and exits.
"""

from __future__ import annotations

import atexit
import http.client
import json
import re
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

HELP = ("/new [ID]  start a new agent (a new conversation)\n"
        "/agents    the server's agents, most recently used first\n"
        "/help      this list\n"
        "/quit      leave (Ctrl-D too); Ctrl-C stops a reply\n"
        '"""        on a line of its own: a block of several lines, ended by another """')
BLOCK = '"""'
PROGRESS = re.compile(r"^: prefill (\d+)/(\d+) prompt tokens")


class ChatError(Exception):
    """The server refused a request or could not be reached (the message says which)."""


@dataclass
class TurnStats:
    n_prompt: int = 0
    n_cached: int = 0
    n_output: int = 0
    first_token_s: float | None = None
    total_s: float = 0.0

    def line(self) -> str:
        speed = (f", {(self.n_output - 1) / (self.total_s - self.first_token_s):.1f} tok/s"  # after the first
                 if self.first_token_s is not None and self.n_output > 1 and self.total_s > self.first_token_s else "")
        first = f"{self.first_token_s:.2f} s" if self.first_token_s is not None else "-"
        return (f"[{self.n_cached}/{self.n_prompt} prompt tokens from cache, first token {first}, "
                f"{self.n_output} tokens{speed}]")


@dataclass(frozen=True)
class Progress:
    """How far the prompt's prefill got: tokens in the cache (reused or computed) of the prompt's."""

    n_ready: int
    n_prompt: int


class ChatClient:
    """The direct agent API of the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self._headers = {"content-type": "application/json", **({"x-api-key": api_key} if api_key else {})}
        self._timeout_s = timeout_s

    def _request(self, method: str, path: str, body: Any = None) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.request(method, path, None if body is None else json.dumps(body), self._headers)
            return connection.getresponse()
        except OSError as exc:
            connection.close()
            raise ChatError(f"no server answers at http://{self._host}:{self._port} ({exc}); "
                            "start one with `semantic serve`") from None

    def _json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        response = self._request(method, path, body)
        with response:
            data = response.read()
        try:
            return response.status, json.loads(data or b"null")
        except ValueError:
            return response.status, None

    def ensure_agent(self, agent_id: str, system_prompt: str | None) -> bool:
        """The agent, created if missing; True if it was created."""
        status, _ = self._json("GET", f"/v1/agents/{urllib.parse.quote(agent_id, safe='')}")
        if status == 200:
            return False
        if status != 404:
            raise ChatError(f"GET /v1/agents/{agent_id}: {status}")
        body: dict[str, Any] = {"id": agent_id, **({"system_prompt": system_prompt} if system_prompt else {})}
        status, answer = self._json("POST", "/v1/agents", body)
        if status != 201:
            raise ChatError(_error_text(status, answer))
        return True

    def agents(self) -> list[dict[str, Any]]:
        status, answer = self._json("GET", "/v1/agents?limit=20")
        if status != 200:
            raise ChatError(_error_text(status, answer))
        return list(answer["data"])

    def turn(self, agent_id: str, text: str, max_tokens: int,
             temperature: float | None) -> Generator[str | Progress | TurnStats, None, None]:
        """Stream one turn: the prefill's progress while there is some, the reply's text
        pieces, then its ``TurnStats``."""
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                                "stream": True, **({"temperature": temperature} if temperature is not None else {})}
        sent = time.perf_counter()
        response = self._request("POST", f"/v1/agents/{urllib.parse.quote(agent_id, safe='')}/generate", body)
        stats = TurnStats()
        with response:
            if response.status != 200:
                raise ChatError(_error_text(response.status, _loads(response.read())))
            for event, data in _events(response):
                if event == "progress":
                    yield Progress(data["n_ready"], data["n_prompt"])
                elif event == "message_start":
                    usage = data["message"]["usage"]
                    stats.n_cached = usage["cache_read_input_tokens"]
                    stats.n_prompt = (usage["input_tokens"] + usage["cache_read_input_tokens"]
                                      + usage["cache_creation_input_tokens"])
                elif event == "content_block_delta" and data["delta"].get("type") == "text_delta":
                    if stats.first_token_s is None:
                        stats.first_token_s = time.perf_counter() - sent
                    yield data["delta"]["text"]
                elif event == "message_delta":
                    stats.n_output = data["usage"]["output_tokens"]
                elif event == "error":
                    raise ChatError(data.get("error", {}).get("message", "the server ended the reply with an error"))
        stats.total_s = time.perf_counter() - sent
        yield stats


def _events(response: http.client.HTTPResponse) -> Iterator[tuple[str, dict[str, Any]]]:
    """Server-sent events: (event name, its JSON data); a prefill progress comment as a
    ``progress`` event."""
    event = ""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if (progress := PROGRESS.match(line)) is not None:
            yield "progress", {"n_ready": int(progress[1]), "n_prompt": int(progress[2])}
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, json.loads(line[5:])


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _error_text(status: int, answer: Any) -> str:
    message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
    return f"the server answered {status}: {message or answer}"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Model output as a terminal may show it: control characters (an escape sequence's ESC,
    which would move the cursor, recolour or retitle the terminal) written as ``\\x1b``;
    newlines and tabs kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def new_agent_id() -> str:
    return f"chat-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def line_editing(history: Path | None) -> None:
    """Line editing and a history for ``input()`` (readline; its history kept in ``history``).
    Bracketed paste (on by default since readline 8.1) makes a paste of several lines one line."""
    try:
        import readline
    except ImportError:  # no readline (some Python builds): plain input
        return
    readline.parse_and_bind("set enable-bracketed-paste on")
    if history is None:
        return
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(_save_history, readline, history)


def _save_history(readline: Any, history: Path) -> None:
    try:
        readline.write_history_file(history)
    except OSError:
        pass


def read_turn(read: Callable[[str], str], prompt: str = "> ") -> str | None:
    """The next turn's text (None at the end of input): a line, or the lines between two
    lines of ``\"\"\"`` (one turn, indentation kept)."""
    try:
        line = read(prompt)
    except EOFError:
        return None
    if line.strip() != BLOCK:
        return line
    lines: list[str] = []
    while True:
        try:
            more = read("... ")
        except EOFError:
            break
        if more.rstrip().endswith(BLOCK):
            lines.append(more.rstrip()[:-len(BLOCK)])
            break
        lines.append(more)
    return "\n".join(lines).rstrip("\n")


def ask_once(client: ChatClient, agent_id: str | None, question: str, *, system_prompt: str | None = None,
             max_tokens: int = 512, temperature: float | None = None, stdout: TextIO = sys.stdout,
             stderr: TextIO = sys.stderr) -> int:
    """Answer ``question`` once (``semantic chat "question"``): the reply on ``stdout``, its
    line of numbers on ``stderr``; returns the exit status (1: the server refused or is gone)."""
    def say(text: str, end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    try:
        agent = agent_id or new_agent_id()
        client.ensure_agent(agent, system_prompt)
        for piece in client.turn(agent, question, max_tokens, temperature):
            if isinstance(piece, TurnStats):
                say("")
                stderr.write(piece.line() + "\n")
            elif isinstance(piece, str):
                say(printable(piece), end="")
    except ChatError as exc:
        stderr.write(f"semantic chat: {exc}\n")
        return 1
    return 0


def run(client: ChatClient, agent_id: str | None, *, system_prompt: str | None = None, max_tokens: int = 512,
        temperature: float | None = None, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
        history: Path | None = None) -> int:
    """The chat loop; returns the exit status (0; 1 when the server cannot be reached).
    In a terminal, input goes through readline (``history``: its file)."""
    def say(text: str, end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    def start(wanted: str | None) -> str:
        chosen = wanted or new_agent_id()
        created = client.ensure_agent(chosen, system_prompt)
        say(f"agent {chosen} ({'new' if created else 'continuing its latest conversation'}); /help for commands")
        return chosen

    interactive = stdin.isatty() and stdin is sys.stdin
    if interactive:
        line_editing(history)

    def read(prompt: str) -> str:
        if interactive:
            return input(prompt)
        line = stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    try:
        agent = start(agent_id)
    except ChatError as exc:
        say(f"semantic chat: {exc}")
        return 1
    while True:
        try:
            entered = read_turn(read)
        except KeyboardInterrupt:
            say("")
            return 0
        if entered is None:
            return 0
        text = entered.strip()
        if not text:
            continue
        try:
            if text in ("/quit", "/exit"):
                return 0
            if text == "/help":
                say(HELP)
            elif text == "/agents":
                for row in client.agents():
                    say(f"{row['id']}  {row.get('n_messages', 0)} messages  {row.get('tier', '')}  "
                        f"last used {row.get('last_access_at', '')}")
            elif text.split()[0] == "/new":
                agent = start(text.split(maxsplit=1)[1] if " " in text else None)
            elif text.startswith("/"):
                say(f"unknown command {text.split()[0]}; /help lists them")
            else:
                _reply(client, agent, text, max_tokens, temperature, say, show_progress=stdout.isatty())
        except ChatError as exc:
            say(f"semantic chat: {exc}")


def _reply(client: ChatClient, agent: str, text: str, max_tokens: int, temperature: float | None,
           say: Any, show_progress: bool = False) -> None:
    turn = client.turn(agent, text, max_tokens, temperature)
    shown = False  # a progress bar is on the line
    try:
        for piece in turn:
            if isinstance(piece, Progress):
                if show_progress and piece.n_prompt:
                    say(f"\r{progress_bar(piece.n_ready, piece.n_prompt)}", end="")
                    shown = True
                continue
            if shown:
                say("\r\x1b[K", end="")  # the bar's line cleared for the reply
                shown = False
            if isinstance(piece, TurnStats):
                say("")
                say(piece.line())
            else:
                say(printable(piece), end="")
    except KeyboardInterrupt:
        turn.close()  # closes the connection: the server cancels the generation
        say("\n[stopped]")


def progress_bar(n_ready: int, n_prompt: int, width: int = 30) -> str:
    """``[prefill ######......  45%  1024/4249 prompt tokens]``"""
    done = min(width, width * n_ready // max(1, n_prompt))
    return f"[prefill {'#' * done}{'.' * (width - done)} {100 * n_ready // max(1, n_prompt):3d}%  " \
           f"{n_ready}/{n_prompt} prompt tokens]"
