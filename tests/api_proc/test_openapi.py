"""GET /openapi.json, fuzzed with schemathesis against a live server: for every route and method of the
document, generated requests (valid and invalid, a fixed number per route, a fixed seed) get no 5xx,
responses that conform to the document (status, content type, body schema: the schemas are closed, so an
undocumented field fails too), auth as declared, and every error body in OpenAI's shape. The server runs
with keys, a max_tokens cap and a small --max-n, so each generated request stays small.

Not checked: that every schema-valid request is accepted (schemathesis' positive_data_acceptance). The
document gives the bodies' types; the server also checks values (ranges, token ids in the vocabulary,
the context length, a known model, a non-empty prompt) and answers those with OpenAI's 400 or 404."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from pagoda.api_proc import openapi
from pagoda.api_proc.auth import ADMIN_ROUTES, USER_ROUTES
from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from pagoda.api_proc.web_ui import PAGE_PATHS

USER_KEY, ADMIN_KEY = "user-key-for-openapi", "admin-key-for-openapi"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}  # an admin key is a user key too
EXAMPLES_PER_ROUTE = 40  # valid and invalid ones
TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "temperature": 0}
# Requests that succeed, one per kind of answer, so every success body is checked against the document too
# (generated requests mostly meet the server's value checks: 400s).
VALID = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
    ("/v1/completions", {"prompt": ["A", "B"], "n": 2, "max_tokens": 2, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "prompt_logprobs": 1, "seed": 1, "temperature": 1}),
    (
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1, "n": 2}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 8, "tools": [TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}),
    ("/tokenize", {"prompt": "Hello", "return_token_strs": True}),
    ("/tokenize", {"messages": CHAT["messages"], "tools": [TOOL]}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--api-key", USER_KEY, "--admin-key", ADMIN_KEY, "--max-tokens-cap", "8", "--max-n", "2",
        "--max-body-size", "1MiB",
    )  # fmt: skip


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json", headers=AUTH)


@schemathesis.check
def openai_error_shape(ctx, response, case) -> None:
    """Every 4xx/5xx answers {"error": {"message": str, "type": str, "param": str|null, "code": str|null}}."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), error


ROUTES = [(route.method, route.path) for route in [*openapi.ROUTES, *openapi.page_routes()]]


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_conforms(api_schema, method, path):
    operation = api_schema[path][method]

    @given(
        case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    )
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck))
    @seed(20261202)
    def run(case):
        case.call_and_validate(
            headers=AUTH, additional_checks=[openai_error_shape], excluded_checks=[positive_data_acceptance]
        )

    run()


@pytest.mark.parametrize(("path", "body"), VALID, ids=[f"{p} {i}" for i, (p, _) in enumerate(VALID)])
def test_successful_answers_conform(api_schema, path, body):
    case = api_schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(headers=AUTH, additional_checks=[openai_error_shape])
    assert response.status_code == 200, response.text


def test_the_document_covers_every_route_with_auth_declared(server):
    status, document = http("GET", server.base_url + "/openapi.json", headers=AUTH)
    assert status == 200 and document["openapi"] == "3.1.0"
    operations = {(method.upper(), path): op for path, item in document["paths"].items() for method, op in item.items()}
    assert {("POST", "/v1/chat/completions"), ("POST", "/detokenize"), ("GET", "/dashboard.json")} <= set(operations)
    assert {path for _, path in operations} >= USER_ROUTES | ADMIN_ROUTES | PAGE_PATHS
    assert document["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    for (_, path), operation in operations.items():
        keyed = path in USER_ROUTES or path in ADMIN_ROUTES
        assert operation["security"] == ([{"bearerAuth": []}] if keyed else []), path
    # Generated from the types: the request and response structs are all there, by their class names.
    schemas = document["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatCompletion", "ErrorResponse", "Usage"} <= set(schemas)
    assert schemas["ChatCompletion"]["additionalProperties"] is False


def test_without_a_key_it_is_refused_in_openais_shape(server):
    status, body = http("GET", server.base_url + "/openapi.json")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_schemathesis_cli_all_phases_and_checks(server, tmp_path):
    """The command line's coverage phase as well (boundary values, nulls, wrong types, undeclared
    methods: a 405 must name the allowed ones in `Allow`) and every built-in check but positive data
    acceptance (above); bounded by examples per route and a seed."""
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"), "run", server.base_url + "/openapi.json",
            "-H", f"Authorization: Bearer {ADMIN_KEY}", "--phases", "examples,coverage,fuzzing",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", "30", "--seed", "20261202", "--no-color",
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,  # (its .schemathesis/ cache goes there)
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", run.stdout)  # every case it made passed
    assert cases and cases[1] == cases[2] and int(cases[1]) > 300, run.stdout[-3000:]
