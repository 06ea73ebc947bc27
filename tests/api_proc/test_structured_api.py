"""Structured output and tool calls through a real `pagoda serve`, with the official `openai` SDK and
the direct client: every spelling of a constraint works, bad specs are 400s that hurt nothing else,
tool calls parse and match their schema, streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from pagoda.api_proc.client import EngineClient, EngineError
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.structured_params import StructuredOutputsParams

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10},
        "y": {"type": "integer", "minimum": -10, "maximum": 10},
        "label": {"enum": ["start", "end", "waypoint"]},
    },
    "required": ["x", "y", "label"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_forecast", "description": "Weather forecast for a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 32}},
                "required": ["timezone"],
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]


def test_chat_json_schema_samples_validate_and_stream_the_same(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give a point on a map as JSON."}],
        temperature=1.0,
        seed=11,
        n=4,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}},
    )
    response = client.chat.completions.create(**kwargs)
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), POINT)
        assert choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(4)
    }
    assert streamed == {c.index: c.message.content for c in response.choices}


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_json": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        ({"guided_json": json.dumps(POINT)}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"guided_grammar": 'root ::= "(" [0-9]+ (" + " [0-9]+){0,2} ")"'},
            lambda t: re.fullmatch(r"\([0-9]+( \+ [0-9]+){0,2}\)", t),
        ),
        ({"structured_outputs": {"json": POINT}}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"structured_outputs": {"grammar": 'root ::= "a"+ "b"'}}, lambda t: re.fullmatch("a+b", t)),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_every_spelling_constrains_completions(client, extra, check):
    response = client.completions.create(
        model=MODEL_NAME, prompt="Answer:", max_tokens=48, temperature=1.0, seed=2, n=2, extra_body=extra
    )
    for choice in response.choices:  # (seed 2: every sample is complete within 48 tokens)
        assert choice.finish_reason == "stop" and check(choice.text), (choice.finish_reason, choice.text)


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"guided_regex": "(ab"}, "guided_regex", "Regex parsing error"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", 'Rule "nothing" is not defined'),
        ({"guided_json": {"type": "strng"}}, "guided_json", "cannot be compiled"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "'uniqueItems' at $",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "Only one output constraint"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs",
            "disable_any_whitespace",
        ),
        ({"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern", "not supported"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
        ({"tools": TOOLS, "tool_choice": "bogus"}, "tool_choice", "expected"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "'tools'"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "if": {}}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "'if' at",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_400s_naming_the_field(server, extra, param, fragment, stream):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
        **extra,
    }
    status, answer = http("POST", server.base_url + "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and fragment in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_a_refusal_names_each_requests_own_field_though_the_spec_is_shared(server):
    """One schema (a circular `$ref`) sent as `guided_json`, then as the parameters of a named
    `tool_choice`, then as `guided_json` again: the engine compiles (and refuses) it once, and each 400
    names the field of its own request, in `param` and in the message."""
    circular = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    named = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": circular}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, field in (
        ({"guided_json": circular}, "guided_json"),
        (named, "tools"),
        ({"guided_json": circular}, "guided_json"),
    ):
        status, answer = http("POST", server.base_url + "/v1/chat/completions", {**body, **extra})
        assert status == 400 and answer["error"]["param"] == field, answer
        assert (
            answer["error"]["message"].startswith(f"Invalid '{field}': ") and "Circular" in answer["error"]["message"]
        )


def test_a_refused_spec_hurts_nothing_else(server, client):
    status, _ = http(
        "POST", server.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 3, "guided_regex": "[z-a]"}
    )
    assert status == 400
    ok = client.completions.create(
        model=MODEL_NAME,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert ok.choices[0].text and ok.usage.completion_tokens == 8 and ok.choices[0].finish_reason == "length"


def _streamed_calls(chunks) -> tuple[dict[int, dict], list[str]]:
    """Tool calls assembled from stream chunks the way OpenAI documents it, and the finish reasons."""
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        choice = chunk.choices[0]
        assert choice.delta.content is None
        for entry in choice.delta.tool_calls or []:
            call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
            if entry.id:
                assert call["id"] is None and entry.type == "function"  # the id comes once, first
                call["id"], call["name"] = entry.id, entry.function.name
            call["arguments"] += entry.function.arguments or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return calls, finishes


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_match_their_schema_and_stream_the_same(client, tool_choice):
    # One call (parallel_tool_calls=False): allowed several, this small model tends to repeat its call
    # until max_tokens. Several calls in one output are covered by tests/api_proc/test_tool_parsing.py.
    kwargs = dict(
        model=MODEL_NAME,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=100,
        parallel_tool_calls=False,
    )
    for seed in (1, 2, 3):
        response = client.chat.completions.create(**kwargs, temperature=1.0, seed=seed)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        chunks = list(client.chat.completions.create(**kwargs, temperature=1.0, seed=seed, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        calls, finishes = _streamed_calls(chunks)
        assert finishes == ["tool_calls"]
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]


def test_required_single_call_and_tool_history(client):
    history = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_forecast",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24C"}'},
        {"role": "user", "content": "And what time is it in Tokyo?"},
    ]
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    calls = response.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in PARAMETERS
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS[calls[0].function.name])


def test_auto_and_none_answer_with_content_when_the_model_calls_nothing(client):
    prompt_tokens = {}
    for tool_choice in ("auto", "none"):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=12,
            temperature=0,
            messages=[{"role": "user", "content": "Say hello."}],
        )
        choice = response.choices[0]
        assert choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason == ("length" if response.usage.completion_tokens == 12 else "stop")
        prompt_tokens[tool_choice] = response.usage.prompt_tokens
    plain = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1, messages=[{"role": "user", "content": "Say hello."}]
    )
    # The tools are in the prompt under auto (rendered into the system message), not under none.
    assert prompt_tokens["auto"] > prompt_tokens["none"] + 100 and prompt_tokens["none"] == plain.usage.prompt_tokens


def test_direct_client_constrains_and_refuses_like_http(server):
    client = EngineClient(server.frontend)
    try:
        spec = StructuredOutputsParams(json=POINT)
        text = "".join(
            d.text
            for d in client.generate(
                "A point:", SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=spec), timeout=60
            )
        )
        jsonschema.validate(json.loads(text), POINT)
        with pytest.raises(EngineError) as info:
            list(
                client.generate(
                    "x",
                    SamplingParams(
                        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed", source="my_field")
                    ),
                    timeout=60,
                )
            )
        assert info.value.status == 400 and info.value.param == "my_field" and "Regex" in info.value.message
    finally:
        client.close()
