"""API keys, admin key, CORS and every limit of `pagoda serve`, against one real server."""

from __future__ import annotations

import json
import os
import select
import signal
from http.client import HTTPConnection

import openai
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, http, wait_until

USER_KEY, ADMIN_KEY, ORIGIN = "user-key-0123456789", "admin-key-0123456789", "https://app.example"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("access-keys") / "keys.txt"
    key_file.write_text("# second user key\nfile-key-0123456789\n")
    return start_server(
        "--api-key",
        USER_KEY,
        "--api-key-file",
        str(key_file),
        "--admin-key",
        ADMIN_KEY,
        "--max-tokens-cap",
        "12",
        "--max-n",
        "2",
        "--max-prompt-tokens",
        "60",
        "--max-pending-requests",
        "3",
        "--max-body-size",
        "64KiB",
        "--allowed-origin",
        ORIGIN,
        "--log-format",
        "json",
        "--log-requests",
    )


def _open(server, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    """A raw HTTP response left open (for streams and header checks): (connection, response)."""
    connection = HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = json.dumps(body).encode() if body is not None else None
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return connection, connection.getresponse()


def _counter(server, name: str, **labels: str) -> float:
    """One sample of GET /metrics (public on this server), 0 if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", server.base_url + "/metrics")[1]
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _completion(max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, **extra}


def test_no_key_or_a_wrong_key_gets_401_on_every_route(server):
    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("GET", "/version"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/no/such/route"),
        ("GET", "/v1/../reset_prefix_cache"),
        ("GET", "/v1"),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": USER_KEY}):
        for method, path in routes:
            status, body = http(method, server.base_url + path, {} if method == "POST" else None, headers=headers)
            assert status == 401, (method, path, headers, body)
            assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert (
        "Incorrect API key"
        in http("GET", server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong-key-0123456789"})[1][
            "error"
        ]["message"]
    )


def test_keys_open_their_routes_and_only_those(server):
    assert http("GET", server.base_url + "/health")[0] == 200  # probes are public by default
    assert http("GET", server.base_url + "/v1/models", headers=USER)[0] == 200
    assert (
        http("GET", server.base_url + "/v1/models", headers={"Authorization": "Bearer file-key-0123456789"})[0] == 200
    )
    assert http("GET", server.base_url + "/no/such/route", headers=USER)[0] == 404
    status, body = http("POST", server.base_url + "/reset_prefix_cache", headers=USER)
    assert status == 403 and body["error"]["code"] == "admin_key_required"
    assert http("POST", server.base_url + "/reset_prefix_cache", headers=ADMIN)[0] == 200


def test_openai_sdk_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.base_url + "/v1", api_key=USER_KEY)
    assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope-nope-nope").models.list()


def test_limits_answer_with_their_status(server):
    url = server.base_url + "/v1/completions"
    cases = [
        (_completion(max_tokens=13), 400, "integer_above_max_value"),
        (_completion(n=3), 400, "integer_above_max_value"),
        (_completion(prompt="word " * 100), 400, "prompt_too_long"),
    ]
    for body, status, code in cases:
        got_status, got = http("POST", url, body, headers=USER)
        assert (got_status, got["error"]["code"]) == (status, code), got
    rejected = _counter(server, "pagoda:request_rejected_total", status_code="413")
    status, body = http("POST", url, b'{"prompt": "' + b"x" * 70_000 + b'"}', headers=USER)
    assert status == 413 and "error" in body
    assert _counter(server, "pagoda:request_rejected_total", status_code="413") == rejected + 1
    # Without max_tokens the cap is the default: generation stops at 12 tokens.
    status, body = http(
        "POST",
        url,
        {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": None, "ignore_eos": True},
        headers=USER,
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 12


def test_queue_full_gets_429_with_retry_after_then_recovers(server):
    rejected = _counter(server, "pagoda:request_rejected_total", status_code="429")
    aborted = _counter(server, "pagoda:request_aborted_total")
    engine = server.child_named("pagoda-engine")
    os.kill(engine, signal.SIGSTOP)  # nothing finishes while the queue is full, however fast decoding is
    try:
        connections = [HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(4)]
        body = json.dumps(_completion(max_tokens=12, stream=True, ignore_eos=True)).encode()
        for connection in connections:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **USER})
        # three are taken and wait for a first token; the fourth, whichever it is, is answered at once
        answered, _, _ = select.select([c.sock for c in connections], [], [], 30)
        assert len(answered) == 1
        full_connection = next(c for c in connections if c.sock is answered[0])
        full = full_connection.getresponse()
        assert full.status == 429 and full.getheader("Retry-After") == "1"
        assert json.loads(full.read())["error"]["code"] == "too_many_requests"
        taken = [c for c in connections if c is not full_connection]
        assert select.select([c.sock for c in taken], [], [], 0.5)[0] == []  # still waiting
        for connection in connections:
            connection.close()  # the three taken disconnect: their slots free up
    finally:
        os.kill(engine, signal.SIGCONT)
    statuses = []  # of the requests sent until one is taken again

    def taken_again() -> bool:
        statuses.append(http("POST", server.base_url + "/v1/completions", _completion(), headers=USER)[0])
        return statuses[-1] != 429

    assert wait_until(taken_again, 30.0, 0.2) and set(statuses) <= {429, 200}, statuses
    assert statuses[-1] == 200
    # every 429 counted: the one above and those of the retries
    assert _counter(server, "pagoda:request_rejected_total", status_code="429") == rejected + 1 + statuses.count(429)
    assert wait_until(lambda: _counter(server, "pagoda:request_aborted_total") == aborted + 3, 10.0), (
        _counter(server, "pagoda:request_aborted_total") - aborted
    )  # the three that were cut, no more


def test_request_timeout_gives_504_and_frees_the_engine(tmp_path):
    server = PagodaServer(tmp_path, "--request-timeout", "5")
    try:
        _check_timeout(server)
    finally:
        server.stop()


def _check_timeout(server):
    engine = server.child_named("pagoda-engine")
    os.kill(engine, signal.SIGSTOP)  # a stuck engine: the request cannot finish
    try:
        status, body = http("POST", server.base_url + "/v1/completions", _completion())  # (it would hang)
        assert status == 504 and body["error"]["code"] == "request_timeout"
        assert _counter(server, "pagoda:request_timeout_total") == 1
    finally:
        os.kill(engine, signal.SIGCONT)
    statuses = []  # the resumed engine serves again (retried: this box may be busy)

    def serves() -> bool:
        statuses.append(http("POST", server.base_url + "/v1/completions", _completion(max_tokens=1))[0])
        return statuses[-1] == 200

    assert wait_until(serves, 60.0) and set(statuses) <= {504, 200}, statuses


def test_cors_preflight_and_headers(server):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }

    def headers_of(method, path, body=None, headers=None):
        connection, response = _open(server, method, path, body, headers)
        response.read()
        connection.close()
        return response.status, response

    status, response = headers_of("OPTIONS", "/v1/chat/completions", headers=preflight)  # browsers send no key
    assert status == 204 and response.getheader("Access-Control-Allow-Origin") == ORIGIN
    assert "Authorization" in response.getheader("Access-Control-Allow-Headers")
    assert (
        headers_of("OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})[0] == 403
    )
    assert (
        headers_of("GET", "/v1/models", headers={**USER, "Origin": ORIGIN})[1].getheader("Access-Control-Allow-Origin")
        == ORIGIN
    )
    streamed = headers_of("POST", "/v1/completions", _completion(stream=True), {**USER, "Origin": ORIGIN})[1]
    assert streamed.getheader("Content-Type").startswith("text/event-stream")
    assert streamed.getheader("Access-Control-Allow-Origin") == ORIGIN
    status, denied = headers_of("GET", "/v1/models", headers={"Origin": ORIGIN})  # errors carry CORS headers too
    assert status == 401 and denied.getheader("Access-Control-Allow-Origin") == ORIGIN
    refused = headers_of("GET", "/v1/models", headers={**USER, "Origin": "https://x.y"})[1]
    assert refused.getheader("Access-Control-Allow-Origin") is None
    # The answer depends on Origin whatever the origin (or none): a cache must not hand one to another.
    no_origin = headers_of("GET", "/v1/models", headers=USER)[1]
    for response in (refused, no_origin, denied, streamed):
        assert response.getheader("Vary") == "Origin", response.getheaders()


def _request_lines(server) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        entry = json.loads(line)  # --log-format json: every line of every process is a JSON object
        if entry["message"] == "request finished":
            lines.append(entry)
    return lines


def test_one_json_log_line_per_request(server):
    before = len(_request_lines(server))
    status, body = http("POST", server.base_url + "/v1/completions", _completion(max_tokens=5, n=2), headers=USER)
    assert status == 200
    connection, response = _open(
        server,
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 12,
            "stream": True,
            "ignore_eos": True,
        },
        USER,
    )
    response.readline()
    connection.close()  # the client goes away mid-stream
    assert wait_until(lambda: len(_request_lines(server)) >= before + 2, 30.0, 0.2), server.log()[-2000:]
    lines = _request_lines(server)
    assert len(lines) == before + 2  # one line each, no more
    done = next(e for e in lines[before:] if e["request_id"] == body["id"])
    assert (done["status"], done["endpoint"], done["finish_reason"]) == (200, "completions", "length")
    assert done["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert done["completion_tokens"] == body["usage"]["completion_tokens"] == 10
    assert done["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < done["ttft_ms"] <= done["latency_ms"] and done["prompt"] == "Once upon a time"
    gone = next(e for e in lines[before:] if e["endpoint"] == "chat")
    assert gone["status"] == 499 and gone["prompt"][0]["content"] == "Tell me a story"
    assert gone["finish_reason"] is None and gone["completion_tokens"] < 12


def test_prompts_stay_out_of_the_log_unless_asked():
    from pagoda.api_proc.request_log import RequestRecord

    assert "prompt" not in RequestRecord("cmpl-1", "completions").fields()
    assert RequestRecord("cmpl-1", "completions", prompt="secret").fields()["prompt"] == "secret"


def test_undecodable_authorization_header_is_a_401_not_a_500():
    from pagoda.api_proc.auth import AuthPolicy

    policy = AuthPolicy(api_keys=(USER_KEY,))
    # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes
    assert policy.check("/v1/models", "Bearer \udcff\udcfe-not-a-key")[0] == 401
    assert policy.check("/v1/models", f"bearer {USER_KEY}") is None


def test_key_files_take_whole_line_comments_only(tmp_path, monkeypatch):
    from pagoda.api_proc.auth import read_keys

    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# a comment\nkey-with-#-inside-123\n  \n")
    assert read_keys(None, "PAGODA_API_KEY", str(keys)) == ["key-with-#-inside-123"]


def test_max_tokens_cap_defaults_within_the_context():
    from pagoda.detok_proc.limits import FrontendLimits
    from pagoda.detok_proc.requests import RequestInvalid
    from pagoda.engine_core.sampling_params import SamplingParams

    limits = FrontendLimits(max_tokens_cap=4096)
    params = SamplingParams(max_tokens=None)
    limits.cap_max_tokens(params, num_prompt_tokens=5000, max_model_len=8192)
    assert params.max_tokens == 3192  # what the context leaves, not a 400 for a limit nobody asked for
    params = SamplingParams(max_tokens=None)
    limits.cap_max_tokens(params, num_prompt_tokens=10, max_model_len=8192)
    assert params.max_tokens == 4096
    with pytest.raises(RequestInvalid):
        limits.cap_max_tokens(SamplingParams(max_tokens=4097), 10, 8192)


def test_deadline_holds_even_when_deltas_are_already_queued():
    import asyncio

    from pagoda.api_proc.openai_schema import ApiError
    from pagoda.api_proc.server import ApiServer, ApiSettings

    async def run() -> int:
        server = ApiServer(
            ApiSettings(frontend_addr="ipc:///nonexistent/frontend.sock", served_model_names=["m"], request_timeout=0.2)
        )

        async def ready_deltas():  # never suspends: every item is already there
            for i in range(1000):
                yield 0, i

        seen = 0
        with pytest.raises(ApiError) as error:
            async for _ in server._deadline(ready_deltas()):
                seen += 1
                await asyncio.sleep(0.01)  # a slow reader
        assert error.value.status == 504
        return seen

    assert asyncio.run(run()) < 100


def test_n_above_128_is_for_max_n_to_decide():
    import msgspec

    from pagoda.api_proc.openai_schema import ApiError, CompletionRequest
    from pagoda.api_proc.server import ApiServer, ApiSettings

    params = msgspec.convert({"prompt": "x", "n": 200}, CompletionRequest).sampling_params(1, None)
    generous = ApiServer(ApiSettings(frontend_addr="ipc:///nonexistent/a.sock", served_model_names=["m"], max_n=256))
    assert generous._limited(params).n == 200
    strict = ApiServer(ApiSettings(frontend_addr="ipc:///nonexistent/b.sock", served_model_names=["m"], max_n=100))
    with pytest.raises(ApiError) as refused:
        strict._limited(params)
    assert refused.value.param == "n"
    generous.client.close()
    strict.client.close()
