"""``semantic chat`` shows model output, never runs it (issue 59, item 10): an escape sequence a
model writes (ESC, BEL, a title change) reaches the terminal as visible text."""
from __future__ import annotations

import io
from typing import Any, Iterator

from app.chat import printable, run


def test_control_characters_are_shown_not_sent() -> None:
    assert printable("a\x1b[31mred\x1b[0m\n\tok\x07\x9b") == "a\\x1b[31mred\\x1b[0m\n\tok\\x07\\x9b"
    assert printable("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


class Turn:
    def __init__(self, pieces: list[str]) -> None:
        self._pieces = pieces

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pieces)

    def close(self) -> None:
        pass


class Client:
    def ensure_agent(self, agent_id: str, system_prompt: str | None) -> bool:
        return True

    def turn(self, agent_id: str, text: str, max_tokens: int, temperature: float | None) -> Turn:
        return Turn(["Hello ", "\x1b]0;pwned\x07", "\x1b[2J world"])


def test_a_reply_with_escape_sequences_reaches_the_terminal_as_text() -> None:
    out = io.StringIO()
    assert run(Client(), "a", stdin=io.StringIO("hi\n"), stdout=out) == 0  # type: ignore[arg-type]
    shown = out.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown
    assert "Hello \\x1b]0;pwned\\x07\\x1b[2J world" in shown
