"""The Responses API protocol with plain values: Codex's recorded requests, items both ways,
the event stream against the whole reply, errors."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import ContextTooLong, EngineUnavailable, InvalidRequest, NotFound, Overloaded
from app.protocol import codex, responses, tools
from app.protocol import responses_output as out
from app.protocol.reply import Reply
from app.types import Finished, Heartbeat, RequestOptions, Started, TextDelta

RECORDED = json.loads((Path(__file__).parent / "data" / "codex_requests.json").read_text())
TURN_2 = RECORDED["body"]
TURN_1 = {**TURN_2, "input": TURN_2["input"][:4]}
OPTIONS = RequestOptions(default_temperature=0.0)
FINISHED = Finished("end_turn", None, 100, 90, 10, 7, 0.2, 1.4)
RID = "resp_test"


def parse(body: dict[str, Any], **options: Any) -> Any:
    return responses.parse_request(body, RequestOptions(**{"default_temperature": 0.0, **options}))


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hi", **fields}


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one.",
                     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}]}


def test_codex_turn_is_one_system_message_then_alternating_turns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        turn = parse(TURN_2)
    assert [m.role for m in turn.messages] == ["system", "user", "assistant", "user"]
    system = turn.messages[0].content
    assert system.startswith("You are a coding agent running in the Codex CLI")
    assert "<skills_instructions>" in system and tools.CALL_START in system
    assert '"multi_agent_v1.spawn_agent"' in system and '"exec_command"' in system
    assert "web_search" not in system and "hosted tool 'web_search' left out" in caplog.text
    assert turn.messages[1].content.startswith("<environment_context>")
    assert turn.messages[1].content.endswith("\nWhat is 2+2?")  # two user items, one turn
    assert turn.parse_tools and turn.sampling.end_after == (tools.CALL_END,) and turn.sampling.temperature == 0.0
    assert turn.stream and not turn.details.store  # Codex sends store: false
    assert [label for label, _ in turn.parts][:4] == ["input.0", "input.1", "tools", "input.2"]


def test_codex_second_turn_continues_the_first_conversation_and_prompt() -> None:
    first, second = parse(TURN_1), parse(TURN_2)
    assert second.system_digest == first.system_digest
    assert second.message_digests[:4] == first.message_digests  # history: the same conversation
    assert second.messages[:2] == first.messages[:2]  # the prompt: turn 1's plus the reply and the new message
    reply = out.history_items(RID, first, "4")
    assert [responses.item_digest(item) for item in reply] == [second.message_digests[4]]


def test_fitting_drops_codex_optional_sections_but_not_the_identity() -> None:
    whole, fitted = parse(TURN_2), parse(TURN_2, fit=True)
    assert fitted.message_digests == whole.message_digests and fitted.system_digest == whole.system_digest
    system = fitted.messages[0].content
    assert "<skills_instructions>" not in system and "## Presenting your work" not in system
    assert "## Task execution" in system and "## Validating your work" in system and "# Tool Guidelines" in system
    assert len(system) < len(whole.messages[0].content) - 10_000
    assert fitted.messages[1:] == whole.messages[1:]


def test_drop_optional_sections_keeps_what_follows_each() -> None:
    text = "Intro\n\n## Keep\nA\n## Responsiveness\nB\n### Preamble\nC\n## Task\nD\n# Top\nE"
    assert codex.drop_optional_sections(text) == "Intro\n\n## Keep\nA\n## Task\nD\n# Top\nE"
    assert codex.drop_optional_sections("no headings") == "no headings"
    assert codex.is_optional_message("<skills_instructions>\n...") and not codex.is_optional_message("x")


def test_namespace_tools_are_flattened_and_calls_return_with_their_namespace() -> None:
    turn = parse(body(tools=[WEATHER, AGENTS]))
    reply = '<tool_call>\n{"name": "multi_agent_v1.spawn_agent", "arguments": {"message": "go"}}\n</tool_call>'
    (call,) = out.reply_items(RID, turn, reply)
    assert call["type"] == "function_call" and call["name"] == "spawn_agent"
    assert call["namespace"] == "multi_agent_v1" and json.loads(call["arguments"]) == {"message": "go"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    resent = parse(body(tools=[WEATHER, AGENTS], input=[{"role": "user", "content": "Hi"}, call,
                                                         {"type": "function_call_output", "call_id": call["call_id"],
                                                          "output": "spawned"}]))
    assert resent.messages[2].content == tools.render_call("multi_agent_v1.spawn_agent", {"message": "go"})
    assert resent.message_digests[1] == responses.item_digest(call)
    assert resent.messages[3].content == tools.render_result("spawned", False)


def test_custom_tools_take_one_string_and_come_back_as_custom_tool_calls() -> None:
    turn = parse(body(tools=[PATCH]))
    assert '"apply_patch"' in turn.messages[0].content and '"input": "string"' in turn.messages[0].content
    patch = "*** Begin Patch\n*** End Patch"
    reply = tools.render_call("apply_patch", {"input": patch})
    (call,) = out.reply_items(RID, turn, reply)
    assert call == {"type": "custom_tool_call", "id": call["id"], "status": "completed", "call_id": call["call_id"],
                    "name": "apply_patch", "input": patch}
    resent = parse(body(tools=[PATCH], input=[{"role": "user", "content": "Hi"}, call,
                                              {"type": "custom_tool_call_output", "call_id": call["call_id"],
                                               "output": [{"type": "input_text", "text": "Done!"}]}]))
    assert resent.messages[2].content == reply  # the model sees its own call again
    odd = out.reply_items(RID, turn, tools.render_call("apply_patch", {"text": "x"}))
    assert odd[0]["input"] == '{"text": "x"}'  # whatever it wrote, as the one string


def test_tool_choice() -> None:
    assert parse(body(tools=[WEATHER], tool_choice="required")).reply_prefix == tools.forced_prefix(None)
    named = parse(body(tools=[WEATHER, AGENTS], tool_choice={"type": "function", "name": "spawn_agent"}))
    assert named.reply_prefix == tools.forced_prefix("multi_agent_v1.spawn_agent")
    none = parse(body(tools=[WEATHER], tool_choice="none"))
    assert not none.parse_tools and none.messages[0].role == "user"
    allowed = parse(body(tools=[WEATHER, PATCH], tool_choice={"type": "allowed_tools", "mode": "auto",
                                                                 "tools": [{"type": "custom", "name": "apply_patch"}]}))
    assert '"apply_patch"' in allowed.messages[0].content and "get_weather" not in allowed.messages[0].content
    custom = parse(body(tools=[PATCH], tool_choice={"type": "custom", "name": "apply_patch"}))
    (call,) = out.reply_items(RID, custom, '"input": "x"}}\n</tool_call>')
    assert call["type"] == "custom_tool_call" and call["input"] == "x"


@pytest.mark.parametrize("fields, where", [
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input.0.arguments"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"text": {"format": {"type": "grammar", "name": "x"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}}, "text.format.schema"),
    ({"background": True}, "background"), ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"), ({"truncation": "auto"}, "truncation"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include"),  # (plain text replies only)
    ({"max_output_tokens": 10**9}, "max_output_tokens"), ({"temperature": 3}, "temperature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"model": ""}, "model"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
])
def test_bad_requests_name_the_field(fields: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body(**fields))
    assert info.value.field == where and str(info.value).startswith(f"{where}:")


def test_accepted_and_ignored() -> None:
    turn = parse(body(input=[{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
                             {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "developer", "content": "Now in plan mode."}, {"role": "user", "content": "Go"}],
                      include=["reasoning.encrypted_content"], store=False, parallel_tool_calls=False,
                      prompt_cache_key="k", client_metadata={"a": "b"}, service_tier="auto", truncation="disabled",
                      tools=[{"type": "web_search", "external_web_access": False}], reasoning={"effort": "low"},
                      text={"format": {"type": "text"}, "verbosity": "low"}))
    assert [m.role for m in turn.messages] == ["system", "user"]  # a later developer message joins the user turn
    assert turn.messages[1].content == "Hi\nNow in plan mode.\nGo"
    assert len(turn.raw_messages) == len(turn.message_digests) == 4  # the reasoning item is not kept
    assert not turn.parse_tools and turn.parse_thinking
    assert turn.details.echo["parallel_tool_calls"] is False


def test_instructions_lead_the_system_message() -> None:
    turn = parse(body(instructions="Answer in French.", input=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}]))
    assert turn.messages[0].content == "Answer in French.\n\nBe brief."
    assert turn.system_digest != parse(body(input=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}])).system_digest


def streamed(turn: Any, pieces: list[str], finished: Finished = FINISHED) -> list[dict[str, Any] | Reply]:
    stream = [Started(100, 90, 10), Heartbeat(), *(TextDelta(p) for p in pieces), finished]
    return list(out.render_events(RID, turn, iter(stream)))


def events_for(turn: Any, pieces: list[str], finished: Finished = FINISHED) -> list[dict[str, Any]]:
    return [e for e in streamed(turn, pieces, finished) if not isinstance(e, Reply)]


REPLIES = ["Paris.", "  ", "", "Let me look.  \n" + tools.render_call("get_weather", {"city": "Paris"}),
           "\n" + tools.render_call("get_weather", {"city": "Paris"}) + "\n\nand more  ",
           "<think>The user wants weather.</think>\n\nSunny.", "<think>only thought",
           tools.render_call("apply_patch", {"input": "diff"})]


@settings(max_examples=200, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_the_stream_sends_exactly_the_whole_replys_items(reply: str, cuts: list[int]) -> None:
    turn = parse(body(tools=[WEATHER, PATCH], reasoning={"summary": "auto"}))
    bounds = sorted({0, len(reply), *(c for c in cuts if c < len(reply))})
    pieces = [reply[a:b] for a, b in zip(bounds, bounds[1:])]
    events = events_for(turn, pieces)
    items = out.reply_items(RID, turn, reply)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:3]] == ["response.created", "response.in_progress", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == items
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == items
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["id"]) for e in added] == [(i, item["id"]) for i, item in enumerate(items)]
    texts = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e["item_id"]] = texts.get(e["item_id"], "") + e["delta"]
    for item in items:
        if item["type"] == "message":
            assert texts.get(item["id"], "") == item["content"][0]["text"]
        if item["type"] == "reasoning":
            assert texts[item["id"]] == item["content"][0]["text"]
    assert out.render_response(RID, turn, reply, FINISHED)["output"] == items


@settings(max_examples=200, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=8), store=st.booleans())
def test_the_stream_records_the_reply_it_sent_as_the_whole_reply_records_it(reply: str, cuts: list[int],
                                                                            store: bool) -> None:
    turn = parse(body(tools=[WEATHER, PATCH], reasoning={"summary": "auto"}, store=store))
    bounds = sorted({0, len(reply), *(c for c in cuts if c < len(reply))})
    items = streamed(turn, [reply[a:b] for a, b in zip(bounds, bounds[1:])])
    (at,) = [i for i, e in enumerate(items) if isinstance(e, Reply)]
    sent, last = items[at], items[-1]
    assert isinstance(sent, Reply) and not isinstance(last, Reply)
    assert all(not isinstance(e, Reply) and e["type"] != "response.completed" for e in items[:at])  # before the end
    whole = out.whole_reply(RID, turn, reply, FINISHED)
    assert sent.history == whole.history == tuple(out.history_items(RID, turn, reply))
    assert sent.stored == (last["response"] if store else None)
    assert whole.stored == (whole.body if store else None)
    assert whole.body is not None and whole.body["output"] == last["response"]["output"]


def test_reply_items() -> None:
    turn = parse(body(tools=[WEATHER], reasoning={"summary": "auto"}))
    items = out.reply_items(RID, turn, "<think>Hmm.</think> Let me check.\n" + tools.render_call("get_weather", {}))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert [i["type"] for i in out.history_items(RID, turn, "<think>Hmm.</think>Hi")] == ["message"]
    assert out.history_entry(items[2]) == ("assistant", items[2])
    assert out.history_entry({"type": "function_call_output", "call_id": "c", "output": "x"})[0] == "tool"
    assert out.history_entry({"role": "developer", "content": "x"})[0] == "developer"


def test_the_completed_response_carries_id_and_usage() -> None:
    events = events_for(parse(body(stream=True)), ["Hi"])
    response = events[-1]["response"]
    assert response["id"] == RID and response["status"] == "completed" and response["object"] == "response"
    assert response["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 90,
                                                                               "cache_write_tokens": 10},
                                 "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 107}
    assert events[0]["response"]["usage"] is None and events[0]["response"]["status"] == "in_progress"


def test_a_reply_cut_by_the_clients_bound_is_incomplete() -> None:
    cut = Finished("max_tokens", None, 10, 0, 10, 5, 0.1, 0.2)
    bounded = parse(body(max_output_tokens=5))
    events = events_for(bounded, ["a b c"], cut)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    # Without a bound of its own the client asked for the whole reply (Codex fails a turn on incomplete).
    assert events_for(parse(body()), ["a b c"], cut)[-1]["type"] == "response.completed"


@pytest.mark.parametrize("error, code", [(ContextTooLong(9000, 8191), "context_length_exceeded"),
                                         (Overloaded("busy"), "rate_limit_exceeded"),
                                         (EngineUnavailable("dead"), "server_error")])
def test_an_error_in_the_stream_is_response_failed_and_raised_again(error: Exception, code: str) -> None:
    def failing() -> Any:
        yield Started(10, 0, 10)
        yield TextDelta("Hel")
        raise error

    events: list[dict[str, Any]] = []
    with pytest.raises(type(error)):
        for event in out.render_events(RID, parse(body()), failing()):
            events.append(event)
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": code, "message": str(error)}
    assert failed["response"]["id"] == RID and failed["sequence_number"] == len(events) - 1


def test_error_bodies_name_the_field_and_the_code() -> None:
    bad = out.render_error(400, "input.0.type: nope", InvalidRequest("input.0.type: nope", "input.0.type"))
    assert bad == {"error": {"message": "input.0.type: nope", "type": "invalid_request_error",
                             "param": "input.0.type", "code": None}}
    long = out.render_error(400, "prompt is too long", ContextTooLong(9000, 8191))
    assert long["error"]["code"] == "context_length_exceeded"
    assert out.render_error(429, "busy", Overloaded("busy"))["error"]["code"] == "rate_limit_exceeded"


def test_speculate_extension_turns_speculative_decoding_off_per_request() -> None:
    body = {"model": "m", "input": "hi"}
    assert parse(body).sampling.speculate is True
    assert parse({**body, "speculate": False}).sampling.speculate is False
    with pytest.raises(InvalidRequest):
        parse({**body, "speculate": "no"})


@dataclass(frozen=True)
class StoredPoint:
    items: tuple[Any, ...]


def test_continue_from_puts_the_previous_responses_history_in_front_of_the_input() -> None:
    """A chain: r2 continued r1, so its history holds r1's; a request continuing r2 gets all of it first."""
    ask, answer = {"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "content": "A"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    stored = {"r1": StoredPoint((ask, answer)),
              "r2": StoredPoint((ask, answer, {"role": "user", "content": "b"}, call))}

    def lookup(response_id: str) -> StoredPoint:
        if response_id not in stored:
            raise NotFound(f"response {response_id!r}")
        return stored[response_id]

    result = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
    expanded, point = responses.continue_from({"model": "m", "previous_response_id": "r2", "input": [result]}, lookup)
    assert point is stored["r2"]
    assert expanded == {"model": "m", "previous_response_id": "r2", "input": [*stored["r2"].items, result]}
    expanded, _ = responses.continue_from({"previous_response_id": "r1", "input": "c"}, lookup)
    assert expanded["input"] == [ask, answer, {"role": "user", "content": "c"}]
    assert responses.continue_from({"previous_response_id": "r1"}, lookup)[0]["input"] == [ask, answer]
    alone = {"model": "m", "input": "c"}
    assert responses.continue_from(alone, lookup) == (alone, None)  # nothing to continue: as it came
    with pytest.raises(NotFound):
        responses.continue_from({"previous_response_id": "r9", "input": "c"}, lookup)
    for bad, field in (({"previous_response_id": 7}, "previous_response_id"),
                       ({"previous_response_id": "r1", "input": 7}, "input")):
        with pytest.raises(InvalidRequest) as info:
            responses.continue_from(bad, lookup)
        assert info.value.field == field
