"""Limits on structured output through a real `pagoda serve`, with the official `openai` SDK and the
direct client: an oversized constraint is a 400 naming the limit and its flag, a compile past the time
limit is a 400 naming its flag, and other requests are served all the same."""

from __future__ import annotations

import re
import threading

import openai
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME
from pagoda.api_proc.client import EngineClient, EngineError
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.structured_params import StructuredOutputsParams

FLAGS = (
    "--structured-output-max-properties",
    "3000",
    "--structured-output-max-bytes",
    "256KiB",
    "--structured-output-max-choices",
    "10",
    "--structured-output-compile-timeout",
    "2",
)


def properties(count: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(count)}}


@pytest.fixture(scope="module")
def limited(start_server):
    return start_server(*FLAGS)


@pytest.fixture(scope="module")
def limited_client(limited) -> openai.OpenAI:
    return openai.OpenAI(base_url=limited.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        (
            {"guided_json": properties(3001)},
            "guided_json",
            "the JSON schema has 3001 properties; this server allows at most 3000 (--structured-output-max-properties)",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "items": properties(3001)}},
                }
            },
            "response_format",
            "(--structured-output-max-properties)",
        ),
        (
            {"guided_regex": "a" * (256 * 1024 + 1)},
            "guided_regex",
            "the regex is 262145 bytes long; this server allows at most 262144 bytes (--structured-output-max-bytes)",
        ),
        ({"structured_outputs": {"grammar": 'root ::= "' + "x" * 262144 + '"'}}, "structured_outputs", "max-bytes"),
        (
            {"guided_choice": [f"option {i}" for i in range(11)]},
            "guided_choice",
            "the choice lists 11 choices; this server allows at most 10 (--structured-output-max-choices)",
        ),
    ],
)
def test_oversized_constraints_are_400s_naming_the_limit_and_flag(limited_client, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as refused:
        limited_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
    error = refused.value
    assert error.status_code == 400 and error.param == param and error.code == "constraint_too_large"
    assert fragment in error.message, error.message


def test_a_forced_tool_call_is_held_to_the_limits_too(limited_client):
    tools = [{"type": "function", "function": {"name": "fill", "parameters": properties(3001)}}]
    with pytest.raises(openai.BadRequestError) as refused:
        limited_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required"
        )
    assert refused.value.param == "tools" and "(--structured-output-max-properties)" in refused.value.message


def test_the_engine_holds_direct_clients_to_the_limits(limited):
    client = EngineClient(limited.frontend)
    try:
        spec = StructuredOutputsParams(choice=[str(i) for i in range(11)], source="my_field")
        with pytest.raises(EngineError) as refused:
            list(client.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec), timeout=60))
        assert refused.value.status == 400 and refused.value.param == "my_field"
        assert "(--structured-output-max-choices)" in refused.value.message
    finally:
        client.close()


def test_a_compile_past_the_time_limit_is_a_400_and_others_are_served(limited_client):
    """A schema within the size limits whose compile takes a minute or more (2,000 properties took 38 s
    here) is stopped at the time limit; a small regex sent beside it is served."""
    slow = properties(3000)
    outcome: dict[str, object] = {}

    def send_slow() -> None:
        try:
            limited_client.completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"guided_json": slow}
            )
        except openai.BadRequestError as exc:
            outcome["slow"] = exc

    thread = threading.Thread(target=send_slow)
    thread.start()
    small = limited_client.completions.create(
        model=MODEL_NAME, prompt="Number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}
    )
    thread.join()
    assert re.fullmatch("[0-9]{3}", small.choices[0].text) and small.choices[0].finish_reason == "stop"
    error = outcome["slow"]
    assert isinstance(error, openai.BadRequestError) and error.param == "guided_json"
    assert "took longer than 2 s to compile" in error.message
    assert "(--structured-output-compile-timeout)" in error.message
