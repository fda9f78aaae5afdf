"""Stop sequences over streamed text. Pure.

Text that could still turn out to be the start of a stop sequence is held back,
so a client never receives part of a stop sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    emit: str  # text safe to send now
    stop_sequence: str | None  # the sequence that matched, if one did


class StopMatcher:
    """Feed text segments; learn what may be emitted and whether a stop matched."""

    def __init__(self, stop_sequences: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop_sequences if s)
        self._held = ""

    def feed(self, text: str) -> StopCheck:
        if not self._stops:
            return StopCheck(text, None)
        buffer = self._held + text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self._held = ""
            return StopCheck(buffer[: first[0]], first[1])
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep], None)

    def flush(self) -> str:
        """Text held back when generation ended without a stop sequence."""
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best


class EndMatcher:
    """Whether the output so far contains one of ``ends`` (a tool call's closing tag):
    the turn ends there, the text included."""

    def __init__(self, ends: tuple[str, ...]) -> None:
        self._ends = tuple(e for e in ends if e)
        self._longest = max((len(e) for e in self._ends), default=0)
        self._recent = ""

    def feed(self, text: str) -> bool:
        if not self._ends:
            return False
        window = self._recent + text
        self._recent = window[-(self._longest - 1):] if self._longest > 1 else ""
        return any(end in window for end in self._ends)
