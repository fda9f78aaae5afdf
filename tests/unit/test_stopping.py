from hypothesis import given
from hypothesis import strategies as st

from app.engine.stopping import EndMatcher, StopMatcher


def run(segments: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = []
    for segment in segments:
        check = matcher.feed(segment)
        out.append(check.emit)
        if check.stop_sequence is not None:
            return "".join(out), check.stop_sequence
    return "".join(out) + matcher.flush(), None


def test_no_stops_passes_text_through() -> None:
    assert run(["a", "b"], ()) == ("ab", None)


def test_stop_inside_one_segment_truncates() -> None:
    assert run(["hello END world"], ("END",)) == ("hello ", "END")


def test_partial_stop_is_held_then_released() -> None:
    matcher = StopMatcher(("</answer>",))
    assert matcher.feed("x </ans").emit == "x "
    assert matcher.feed("wer? no").emit == "</answer? no"


def test_earliest_stop_wins() -> None:
    assert run(["a STOP b HALT"], ("HALT", "STOP")) == ("a ", "STOP")


@given(st.text(alphabet="ab\nXY", max_size=30), st.text(alphabet="ab\nXY", min_size=1, max_size=4), st.data())
def test_any_split_gives_the_unsplit_result(text: str, stop: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    segments = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    expected = (text[: text.index(stop)], stop) if stop in text else (text, None)
    assert run(segments, (stop,)) == expected



def first_ending_piece(pieces: list[str]) -> int | None:
    matcher = EndMatcher(("</tool_call>",))
    return next((i for i, piece in enumerate(pieces) if matcher.feed(piece)), None)


def test_end_matcher_stops_on_the_piece_that_completes_the_end() -> None:
    text = 'call <tool_call>{"a": 1}</tool_call> more'
    end = text.index("</tool_call>") + len("</tool_call>")
    for cut in range(len(text) + 1):
        assert first_ending_piece([text[:cut], text[cut:]]) == (0 if cut >= end else 1)
    assert first_ending_piece(list(text)) == end - 1
    assert first_ending_piece(["no end here", "</tool_call"]) is None
    assert not EndMatcher(()).feed("</tool_call>")
