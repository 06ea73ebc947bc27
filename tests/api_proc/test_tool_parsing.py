"""Model output -> OpenAI tool_calls, whole and streamed in every possible cut (no server needed)."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.api_proc.openai_schema import ApiError
from pagoda.api_proc.tool_parsing import CallArrayScanner, ToolCallStream, parse_tagged_calls, tool_response
from pagoda.api_proc.tools import plan_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
CALLS = (
    '[{"name": "search", "arguments": {"q": "say \\"}], [{\\" ok \\\\", "filters": '
    '{"tags": ["x", {"deep": [1, 2]}], "n": null}}}, {"name": "noop", "arguments": {}}]'
)
EXPECTED = [("search", json.dumps(json.loads(CALLS)[0]["arguments"])), ("noop", "{}")]


def _assemble(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], [None, ""])
            if "id" in entry:
                assert call[0] is None and entry["type"] == "function"
                call[0] = entry["function"]["name"]
            call[1] += entry["function"].get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


def _cuts(text: str, rng: random.Random) -> list[list[str]]:
    """The text whole, one character at a time, and in random pieces."""
    pieces = []
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
        pieces.append([text[a:b] for a, b in zip([0] + points, points + [len(text)], strict=True)])
    return [[text], list(text)] + pieces


def test_required_calls_stream_identically_however_the_text_is_cut():
    plan = plan_tools(TOOLS, "required")
    rng = random.Random(0)
    for pieces in _cuts(CALLS, rng):
        stream = ToolCallStream(plan)
        deltas = [stream.step(p, None)[0] for p in pieces[:-1]]
        last, reason = stream.step(pieces[-1], "stop")
        calls = _assemble(deltas + [last])
        assert [(n, json.dumps(json.loads(a))) for n, a in calls] == EXPECTED and reason == "tool_calls"
    message, reason = tool_response(plan, CALLS, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search", "noop"]
    assert message["content"] is None and reason == "tool_calls"


def test_scanner_reports_a_name_only_once_complete():
    scanner = CallArrayScanner()
    assert scanner.feed('[{"name": "sea') == []
    assert scanner.feed('rch", "arguments": {"q"') == [("name", 0, "search"), ("arguments", 0, '{"q"')]
    assert scanner.feed(": 1}}]") == [("arguments", 0, ": 1}")]


def test_a_truncated_forced_call_keeps_what_it_has():
    truncated = '[{"name": "search", "arguments": {"q": "ab'
    message, reason = tool_response(plan_tools(TOOLS, "required"), truncated, "length")
    assert reason == "length" and message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": "ab'}


def test_named_call_streams_the_output_as_arguments():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "search"}})
    stream = ToolCallStream(plan)
    first, _ = stream.step('{"q": ', None)
    assert first["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": '}
    last, reason = stream.step('"x"}', "stop")
    assert last == {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]} and reason == "tool_calls"


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>[{"name": "search", "arguments": {"q": "x"}}]</tool_call>', [("search", '{"q": "x"}')]),
        ('  <tool_call>{"name": "noop", "arguments": {}}</tool_call>\n', [("noop", "{}")]),
        ('<tool_call>[{"name": "search", "arguments": "{\\"q\\": 1}"}]', [("search", '{"q": 1}')]),  # no close tag
        ('<tool_call>[{"name": "unknown", "arguments": {}}]</tool_call>', None),
        ('<tool_call>[{"name": "noop", "arguments": [1]}]</tool_call>', None),
        ('<tool_call>[{"name": "noop", "arguments": {}}]</tool_call> and more', None),
        ('<tool_call>[{"name": "noop", "arguments": {}}', None),
        ('I would call <tool_call>[{"name": "noop", "arguments": {}}]</tool_call>', None),
    ],
)
def test_tagged_calls_parse_only_when_they_are_the_whole_answer(text, expected):
    assert parse_tagged_calls(text, plan_tools(TOOLS, "auto")) == expected


def test_auto_streams_content_at_once_and_holds_back_only_a_possible_call():
    plan = plan_tools(TOOLS, "auto")
    stream = ToolCallStream(plan)
    assert stream.step("Hel", None) == ({"content": "Hel"}, None)
    assert stream.step("lo", "stop") == ({"content": "lo"}, "stop")

    stream = ToolCallStream(plan)
    assert stream.step(" <tool_", None)[0] == {}  # may be a call: held
    assert stream.step("box> no", None)[0] == {"content": " <tool_box> no"}  # was not

    call = '<tool_call>[{"name": "search", "arguments": {"q": "x"}}, {"name": "noop", "arguments": {}}]</tool_call>'
    stream = ToolCallStream(plan)
    assert all(stream.step(c, None)[0] == {} for c in call)
    last, reason = stream.step("", "stop")
    assert _assemble([last]) == [("search", '{"q": "x"}'), ("noop", "{}")] and reason == "tool_calls"

    single = plan_tools(TOOLS, "auto", parallel_tool_calls=False)
    message, reason = tool_response(single, call, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search"]

    broken = "<tool_call>[{oops"
    assert tool_response(plan, broken, "length") == ({"role": "assistant", "content": broken}, "length")


def test_plan_checks_and_schemas():
    assert plan_tools(None, None) is None and plan_tools([], "auto") is None and plan_tools(TOOLS, "none") is None
    with pytest.raises(ApiError, match="unique"):
        plan_tools(TOOLS + TOOLS[:1], "auto")
    with pytest.raises(ApiError, match="parameters"):
        plan_tools([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "auto")
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "noop"}}).constraint()
    assert json.loads(named.json) == {"type": "object", "properties": {}} and named.source == "tools"
    refs = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "$defs": {"U": {"enum": ["c", "f"]}},
                    "type": "object",
                    "properties": {"u": {"$ref": "#/$defs/U"}},
                },
            },
        }
    ]
    schema = json.loads(plan_tools(refs, "required", parallel_tool_calls=False).constraint().json)
    assert schema["maxItems"] == 1
    assert (
        schema["items"]["anyOf"][0]["properties"]["arguments"]["properties"]["u"]["$ref"]
        == "#/items/anyOf/0/properties/arguments/$defs/U"
    )
