import pytest

from app.agents.identity import anthropic_agent, openai_agent, responses_agent
from app.errors import InvalidRequest


@pytest.mark.parametrize("bad", ["agent\n", "agent\r\n", "a b", "", "x" * 129, "agent\u00e9"])
def test_a_session_id_is_the_whole_value_or_refused(bad: str) -> None:
    """``$`` in a pattern passes a trailing newline under re.match: ids must match whole."""
    if not bad:
        assert openai_agent({}, bad) is None  # empty: no session named
        return
    for call in (lambda: openai_agent({}, bad), lambda: anthropic_agent({"X-SESSION-ID": bad}, None),
                 lambda: responses_agent({"SESSION-ID": bad})):
        with pytest.raises(InvalidRequest, match="a session id is 1 to 128"):
            call()


def test_good_session_ids_name_the_agent() -> None:
    assert openai_agent({}, "proj-1:run.2_x").agent_id == "proj-1:run.2_x"
    assert anthropic_agent({"X-SESSION-ID": "a" * 128}, None).agent_id == "a" * 128
