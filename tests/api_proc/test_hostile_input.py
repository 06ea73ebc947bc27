"""Hostile and careless clients against one real server with auth on: every user error is a 4xx in
OpenAI's shape, no single request stalls the others or keeps the tokenizer process's memory, slow
clients are cut off, and no byte of a credential reaches a response or the log."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, http, wait_until
from tests.metrics_scrape import Scrape, delta

KEY = "hostile-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT = BODY_TIMEOUT = 2
MAX_CONNECTIONS = 16
TOKENS_CAP = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = PagodaServer(
        tmp_path_factory.mktemp("hostile"),
        "--api-key",
        KEY,
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--max-tokens-cap",
        str(TOKENS_CAP),
        "--max-n",
        "4",
    )
    yield srv
    srv.stop()
    assert KEY not in srv.log()  # nothing of the key, ever


def _post(server, path: str, body: dict | bytes, headers: dict | None = None):
    return http("POST", server.base_url + path, body, headers={**AUTH, **(headers or {})}, timeout=120)


def _assert_openai_error(status: int, body, param: str | None = "any") -> dict:
    assert 400 <= status < 500, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    if param != "any":
        assert error["param"] == param, error
    return error


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _raw(server, data: bytes, timeout: float = 30.0) -> bytes:
    """Send raw bytes; everything the server answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        return _read_until_closed(s)


def _read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _json_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# ---- 1. nesting -----------------------------------------------------------------------------------


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_deep_nesting_is_a_400_naming_the_field(server):
    deep_list = "[" * 10_000 + "]" * 10_000
    deep_object = '{"a":' * 100_000 + "1" + "}" * 100_000
    deep_schema = '{"type":"object","properties":{"a":' * 2_000 + '{"type":"string"}' + "}}" * 2_000
    chat = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
    cases = [
        ("/v1/completions", f'{{"prompt": {deep_list}, "max_tokens": 1}}', "prompt"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {deep_object}}}]}}', "messages"),
        ("/tokenize", f'{{"prompt": {deep_list}}}', "prompt"),
        ("/tokenize", f'{{"messages": [{{"role": "user", "content": {deep_object}}}]}}', "messages"),
        (
            "/v1/chat/completions",
            chat + f'"response_format": {{"type": "json_schema", "json_schema": '
            f'{{"name": "deep", "schema": {deep_schema}}}}}}}',
            "response_format",
        ),
        # A schema given as a string is parsed by our code, not by the body's parser: the same limit holds.
        ("/v1/chat/completions", chat + f'"guided_json": {json.dumps(deep_schema)}}}', "guided_json"),
    ]
    for path, body, param in cases:
        status, answer = _post(server, path, body.encode())
        error = _assert_openai_error(status, answer, param)
        assert "nested too deeply" in error["message"] and "64" in error["message"], error
    # A realistic schema (25 nested objects) is served.
    schema = {"type": "json_schema", "json_schema": {"name": "ok", "schema": _nested_schema(25)}}
    assert _post(server, "/v1/chat/completions", _chat(response_format=schema))[0] == 200
    assert "Traceback" not in server.log()


# ---- 2. one huge prompt -------------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def test_a_huge_prompt_is_refused_before_tokenizing_and_others_keep_flowing(server, tokenizer):
    """What the tokenizer process tokenized is read from its counter, pagoda:tokenizer_bytes (by where it
    ran: inline in its loop, or on its background thread), not from which answer came first."""
    from pagoda.api_proc.client import AsyncEngineClient, EngineError
    from pagoda.detok_proc.prompt_size import longest_token_bytes
    from pagoda.detok_proc.tokenizing import QUEUE_BYTES
    from pagoda.engine_core.sampling_params import SamplingParams

    tokenized = "pagoda:tokenizer_bytes_total"
    detok = server.child_named("pagoda-detok")
    assert _post(server, "/v1/completions", _completion())[0] == 200
    rss_before = _rss_mb(detok)
    # 31 MB ("a " x 15 Mi), gzipped to ~30 KB: refused from its length; the tokenizer never sees a byte of it.
    before = Scrape(server)
    huge = gzip.compress(json.dumps(_completion(prompt="a " * (15 * 2**20))).encode())
    status, answer = _post(server, "/v1/completions", huge, {"Content-Encoding": "gzip"})
    assert _assert_openai_error(status, answer, "prompt")["code"] == "context_length_exceeded"
    assert delta(before, Scrape(server), tokenized) == 0

    # Prompts just under that bound, of long tokens (80 '#' are one token), pass every check that needs
    # no tokenizing and go to the tokenizer process's background thread, within a budget: past it they
    # get a 429, untokenized. A small request sent after them is tokenized inline: it never waits behind
    # them, and it succeeds.
    max_model_len = http("GET", server.base_url + "/v1/models", headers=AUTH)[1]["data"][0]["max_model_len"]
    big = ("#" * 80 + " ") * ((max_model_len * longest_token_bytes(tokenizer) - 100) // 81)
    count = QUEUE_BYTES // len(big) + 3
    small = "Hello"

    async def send_all() -> dict[str, str]:
        client = AsyncEngineClient(server.frontend)
        answered: dict[str, str] = {}

        async def run(name: str, prompt: str) -> None:
            try:
                async for _ in client.generate(prompt, SamplingParams(max_tokens=1, temperature=0)):
                    pass
                answered[name] = "ok"
            except EngineError as exc:
                answered[name] = exc.code

        try:  # tasks start in order, and one socket keeps the order of what they send
            await asyncio.gather(*[run(f"big{i}", big) for i in range(count)], run("small", small))
        finally:
            client.close()
        return answered

    before = Scrape(server)
    codes = asyncio.run(send_all())
    after = Scrape(server)
    assert codes["small"] == "ok"
    bigs = [codes[f"big{i}"] for i in range(count)]
    assert set(bigs) == {"context_length_exceeded", "too_many_requests"}, bigs
    # Every big one that was not refused for the budget was tokenized on the background thread (and then
    # refused for its token count); the small one, and only it, inline.
    tokenized_bigs = len(bigs) - bigs.count("too_many_requests")
    assert delta(before, after, tokenized, path="background") == tokenized_bigs * len(big)
    assert delta(before, after, tokenized, path="inline") == len(small)
    # The memory of these prompts is given back.
    assert _rss_mb(detok) - rss_before < 150, (rss_before, _rss_mb(detok))


def test_a_tokenize_request_left_by_its_client_is_dropped(server, tokenizer):
    """A client that stops waiting takes its long /tokenize work off the queue with it."""
    from pagoda.api_proc.client import AsyncEngineClient, EngineError
    from pagoda.detok_proc.tokenizing import QUEUE_BYTES

    big = "#" * 200_000  # 200 KB (3,125 tokens, so it fits): the background thread's
    count = QUEUE_BYTES // len(big) + 2  # more than the queue holds at once

    async def leave_then_ask() -> str:
        client = AsyncEngineClient(server.frontend)
        try:
            for _ in range(count):
                with pytest.raises(asyncio.TimeoutError):
                    await client.tokenize(big, timeout=0.0001)  # gone before the answer: aborted
            try:
                await client.tokenize(big)
                return "ok"
            except EngineError as exc:
                return exc.code
        finally:
            client.close()

    assert asyncio.run(leave_then_ask()) == "ok"  # not a 429: the abandoned work left the queue


def test_long_inputs_on_the_background_thread_get_exact_answers(server, tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 1_500  # 67,500 characters: the background path
    status, answer = _post(server, "/tokenize", {"prompt": text})
    assert status == 200 and answer["tokens"] == tokenizer.encode(text)
    ids = answer["tokens"] * 3  # 40,500 ids: decoded on the background thread too
    status, answer = _post(server, "/detokenize", {"tokens": ids})
    assert status == 200 and answer["prompt"] == tokenizer.decode(ids)


# ---- 3. null is absent ----------------------------------------------------------------------------


def test_null_means_the_same_as_absent(server):
    # max_tokens: null is OpenAI's default (16), not "unbounded" (which the cap of 24 would then allow).
    for body in (_completion(max_tokens=None, ignore_eos=True), {"prompt": "Count:", "ignore_eos": True}):
        status, answer = _post(server, "/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 16, answer
    nulls = {
        name: None
        for name in (
            "n",
            "stream",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "user",
            "logprobs",
            "response_format",
            "top_p",
            "echo",
            "stream_options",
            "min_p",
            "stop_token_ids",
            "top_k",
        )
    }
    plain = _post(server, "/v1/completions", _completion(temperature=0, max_tokens=6))
    with_nulls = _post(server, "/v1/completions", _completion(temperature=0, max_tokens=6, **nulls))
    assert plain[0] == with_nulls[0] == 200 and plain[1]["choices"] == with_nulls[1]["choices"]
    chat_nulls = {
        "tools": None,
        "tool_choice": None,
        "max_completion_tokens": None,
        "top_logprobs": None,
        "stream_options": {"include_usage": None},
        "temperature": None,
        "seed": 3,
    }
    assert _post(server, "/v1/chat/completions", _chat(**chat_nulls))[0] == 200


# ---- 4. bodies that do not decode ------------------------------------------------------------------


def test_bodies_that_do_not_match_their_encoding_or_grow_too_large(server):
    status, answer = _post(server, "/v1/completions", json.dumps(_completion()).encode(), {"Content-Encoding": "gzip"})
    assert _assert_openai_error(status, answer)["code"] == "invalid_body_encoding"
    # A gzip bomb: 40 MB of JSON whitespace in 40 KB. The 32 MiB body limit holds after decompression.
    bomb = gzip.compress(b"{" + b" " * (40 * 2**20) + b"}")
    status, answer = _post(server, "/v1/completions", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    assert _post(server, "/v1/completions", _completion())[0] == 200
    assert "Traceback" not in server.log()


def test_a_lone_surrogate_is_named_not_called_truncated(server):
    body = b'{"model": "%s", "max_tokens": 2, "prompt": "\\ud800"}' % MODEL_NAME.encode()
    status, answer = _post(server, "/v1/completions", body)
    message = _assert_openai_error(status, answer)["message"]
    assert "surrogate" in message and "truncated" not in message, message
    status, answer = _post(server, "/v1/completions", body[:-2])  # truly cut short: said so
    message = _assert_openai_error(status, answer)["message"]
    assert "truncated" in message, message


def test_a_content_encoding_other_than_one_decoded_coding_is_refused(server):
    """aiohttp decodes only the exact codings; any other value would leave the body undecoded, read as
    plain JSON. Each is the documented 400, whether the body happens to be plain or gzipped."""
    plain = json.dumps(_completion()).encode()
    for coding in ("x-gzip", "gzip, identity", "gzip;q=1", "identity, gzip", "compress"):
        for body in (plain, gzip.compress(plain)):
            status, answer = _post(server, "/v1/completions", body, {"Content-Encoding": coding})
            assert _assert_openai_error(status, answer)["code"] == "invalid_body_encoding", coding
    assert _post(server, "/v1/completions", gzip.compress(plain), {"Content-Encoding": "GZIP"})[0] == 200
    assert _post(server, "/v1/completions", plain, {"Content-Encoding": "identity"})[0] == 200


# ---- 5. requests that are not HTTP ------------------------------------------------------------------

SECRET = b"SECRETSECRET" * 1000

NOT_HTTP = {
    "content-length and transfer-encoding": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "long header": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SECRET + b"\r\n\r\n",
    "long url": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "unknown method": b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bare CR": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
    "500 headers": b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(500)) + b"\r\n",
    "TLS": bytes.fromhex("16030100a5010000a10303") + bytes(100),
}


def test_requests_that_are_not_http_get_json_no_echo_and_little_log(server):
    log_before = len(server.log())
    for name, data in NOT_HTTP.items():
        status, body = _json_of(_raw(server, data))
        error = _assert_openai_error(status, body)
        assert error["code"] == "invalid_http_request", name
        assert "SECRET" not in json.dumps(body)
    for _ in range(20):  # a flood of one kind
        _raw(server, NOT_HTTP["unknown method"])
    log = server.log()[log_before:]
    assert "SECRET" not in log and "Traceback" not in log and "ERROR" not in log
    warnings = [line for line in log.splitlines() if "not valid HTTP" in line]
    assert 1 <= len(warnings) <= len(NOT_HTTP), warnings  # at most one per kind within the interval


# ---- 6. slow clients --------------------------------------------------------------------------------


def test_slow_headers_and_stalled_bodies_are_cut_off(server):
    # Headers sent one byte at a time, for longer than the header timeout allows.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        answer = b""
        for byte in head:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            s.settimeout(0.1)  # also the pace of the slow client: a byte per 0.1 s at most
            try:
                if (answer := s.recv(4096)) is not None:
                    break
            except TimeoutError:
                continue
        assert answer.startswith(b"HTTP/1.1 408"), answer
        s.settimeout(30)
        _read_until_closed(s)  # and the server closes it
    # A connection that sends nothing at all is closed, quietly (a pool's spare connection needs no answer).
    assert _raw(server, b"") == b""
    # A body shorter than its Content-Length, and a chunked body that never ends.
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    for head in (b'\r\nContent-Length: 100\r\n\r\n{"prompt":', b'\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\n'):
        status, body = _json_of(_raw(server, start + head))
        assert status == 408 and body["error"]["code"] == "request_timeout"
    # A body dripped a byte at a time, each within the idle timeout: far below the minimum rate.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(start + b"\r\nContent-Length: 1000\r\n\r\n")
        answer = b""
        for _ in range(40):  # 40 x 0.5 s would be 20 s; the server gives up after a few
            try:
                s.sendall(b" ")
            except OSError:
                break
            s.settimeout(BODY_TIMEOUT / 4)  # the drip's pace: a byte per half the idle timeout
            try:
                if answer := s.recv(4096):
                    break
            except TimeoutError:
                continue
        assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_long_quiet_stream_is_not_cut_off(server):
    """The header and body timeouts are for requests arriving; a response may take its time (an engine
    stopped mid-stream for longer than both) and be read slowly."""
    engine = server.child_named("pagoda-engine")
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        body = json.dumps(_completion(max_tokens=TOKENS_CAP, ignore_eos=True, stream=True)).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        first = s.recv(200)
        assert first.startswith(b"HTTP/1.1 200")
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(HEADER_TIMEOUT + BODY_TIMEOUT + 1)  # the stall under test, not a wait for the server
        finally:
            os.kill(engine, signal.SIGCONT)
        stream = first + _read_until_closed(s)
    assert stream.count(b"data: {") == TOKENS_CAP and b"data: [DONE]" in stream


def _keep_alive_request(server) -> socket.socket:
    """A connection that has made one request and stays open, idle."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    return s


def test_the_connection_cap_reclaims_idle_connections_and_refuses_when_all_are_busy(server):
    # Idle keep-alive connections fill the cap: a new client still gets in, and the oldest idle one goes.
    idle = [_keep_alive_request(server) for _ in range(MAX_CONNECTIONS)]
    try:
        assert http("GET", server.base_url + "/v1/models", headers=AUTH)[0] == 200
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""  # closed by the server to make room
    finally:
        for s in idle:
            s.close()
    # Connections all busy with requests (each handler waits for the rest of its body): a new one gets a
    # 503 at once and is closed, holding nothing. Each sends `Expect: 100-continue`, so that its "100
    # Continue" proves its head was read before the probe: a connection whose head is still arriving
    # counts as idle and would be closed to make room, which is right, but not what this checks.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        b"Expect: 100-continue\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    )
    busy = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in busy:
            s.sendall(head)
        for s in busy:
            assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        probe = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        assert _raw(server, probe).startswith(b"HTTP/1.1 503")
    finally:
        for s in busy:
            s.close()  # mid-body: a client gone is no server error
    assert wait_until(lambda: http("GET", server.base_url + "/v1/models", headers=AUTH)[0] == 200, 30)
    assert "Traceback" not in server.log() and " 500 " not in server.log()


# ---- 7. what cannot be honoured, and the request log --------------------------------------------------


def test_what_cannot_be_honoured_is_refused_naming_the_field(server):
    remote = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "http://example.com/s.json"}}}
    cases = [
        ("/v1/chat/completions", _chat(response_format=remote), "response_format"),
        ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        ("/v1/completions", _completion(stop=""), "stop"),
        ("/v1/completions", _completion(stop=["end", ""]), "stop"),
        ("/v1/completions", _completion(stop=[f"s{i}" for i in range(65)]), "stop"),
        ("/v1/completions", _completion(stop="x" * 1025), "stop"),
        ("/v1/completions", _completion(logit_bias={"999999": 1}), "logit_bias"),
        ("/v1/completions", _completion(stop_token_ids=[999999]), "stop_token_ids"),
        ("/v1/chat/completions", _chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
        ("/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs"),
        ("/v1/chat/completions", _chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
        ),
        ("/v1/completions", _completion(logit_bias={"\u00b2": 1}), "logit_bias"),
        ("/v1/completions", _completion(logit_bias={"9" * 5000: 1}), "logit_bias"),
    ]
    for path, body, param in cases:
        error = _assert_openai_error(*_post(server, path, body), param)
        assert "apply_chat_template" not in error["message"] and "transformers" not in error["message"]


def _call(**fields) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}, **fields}


def test_assistant_turns_are_refused_where_openai_refuses_them(server):
    """`tool_calls` must be a list of well-formed calls, and an assistant message needs `content` or
    `tool_calls`: each refusal names the field, on /v1/chat/completions and /tokenize alike."""

    def turns(assistant: dict) -> list[dict]:
        return [{"role": "user", "content": "Hi"}, {"role": "assistant", **assistant}]

    cases = [
        ({"content": "ok", "tool_calls": "x"}, "messages[1].tool_calls", "invalid_type"),
        ({"content": None, "tool_calls": {"id": "call_1"}}, "messages[1].tool_calls", "invalid_type"),
        ({"tool_calls": ["x"]}, "messages[1].tool_calls[0]", "invalid_type"),
        ({"tool_calls": [_call(id=None)]}, "messages[1].tool_calls[0].id", "missing_required_parameter"),
        ({"tool_calls": [_call(id=7)]}, "messages[1].tool_calls[0].id", "invalid_type"),
        ({"tool_calls": [_call(type="tool")]}, "messages[1].tool_calls[0].type", None),
        ({"tool_calls": [_call(function=None)]}, "messages[1].tool_calls[0].function", "missing_required_parameter"),
        (
            {"tool_calls": [_call(function={"arguments": "{}"})]},
            "messages[1].tool_calls[0].function.name",
            "missing_required_parameter",
        ),
        (
            {"tool_calls": [_call(function={"name": "f", "arguments": {"a": 1}})]},
            "messages[1].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        ({}, "messages[1].content", "missing_required_parameter"),
        ({"content": None}, "messages[1].content", "missing_required_parameter"),
        ({"content": None, "tool_calls": []}, "messages[1].content", "missing_required_parameter"),
    ]
    for assistant, param, code in cases:
        for path, body in (
            ("/v1/chat/completions", _chat(messages=turns(assistant))),
            ("/tokenize", {"messages": turns(assistant)}),
        ):
            error = _assert_openai_error(*_post(server, path, body), param)
            assert error["code"] == code and error["type"] == "invalid_request_error", (path, assistant, error)
    # What OpenAI takes: calls without content (null or absent), content without calls, both.
    for assistant in (
        {"content": None, "tool_calls": [_call()]},
        {"tool_calls": [_call()]},
        {"content": ""},
        {"content": "ok", "tool_calls": [_call()]},
    ):
        status, reply = _post(
            server,
            "/v1/chat/completions",
            _chat(messages=turns(assistant) + [{"role": "tool", "tool_call_id": "call_1", "content": "1"}]),
        )
        assert status == 200, (assistant, reply)


def test_an_expectation_other_than_100_continue_is_a_417_in_openais_shape(server):
    """On every path, a route's, an unknown one, the key-protected ones (the 417 comes before the key is
    checked, as aiohttp answers an Expect before any middleware): OpenAI's envelope, nothing echoed."""
    for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/nope")):
        status, body = http(
            method, server.base_url + path, b"{}" if method == "POST" else None, headers={"Expect": "200-ok"}
        )
        error = _assert_openai_error(status, body, None)
        assert status == 417 and error["code"] == "expectation_failed" and "200-ok" not in error["message"], body


def _request_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if "request finished" in line]


def test_every_generation_request_leaves_a_log_line(server):
    before = len(_request_lines(server))
    assert _post(server, "/v1/completions", _completion())[0] == 200
    assert _post(server, "/v1/completions", b"{not json")[0] == 400
    assert _post(server, "/v1/chat/completions", _chat(n="two"))[0] == 400
    assert _post(server, "/v1/chat/completions", _chat(model="no-such-model"))[0] == 404
    assert wait_until(lambda: len(_request_lines(server)) >= before + 4, 10)
    statuses = [line.split("status=")[1].split()[0] for line in _request_lines(server)[before:]]
    assert statuses == ["200", "400", "400", "404"]


def test_a_request_that_fails_is_logged_as_500(caplog):
    from pagoda.api_proc.request_log import RequestRecord, logged

    with (
        caplog.at_level("INFO", logger="pagoda.requests"),
        pytest.raises(RuntimeError),
        logged(RequestRecord("cmpl-1", "completions")),
    ):
        raise RuntimeError("a bug")
    assert [r.fields["status"] for r in caplog.records] == [500]


# ---- fuzz ------------------------------------------------------------------------------------------

EDGE_NUMBERS = st.sampled_from([0, -1, 1, 2, 49151, 49152, 2**31 - 1, 2**31, 2**63, 2**64, 10**30, 0.5, 1e308])
KEYS = st.text(max_size=8) | st.sampled_from(["-1", "49152", "2147483648", "type", "json_schema", "schema", "$ref"])
# A placeholder for an array nested `d` deep, written into the body text after json.dumps (which
# could not write a value deeper than Python's recursion limit itself).
DEEP = st.integers(1, 3_000).map(lambda depth: f"__deep_{depth}__")
_DEEP_TEXT = re.compile(r'"__deep_(\d+)__"')
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | EDGE_NUMBERS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | DEEP,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=10,
)


def _body(value) -> bytes:
    return _DEEP_TEXT.sub(lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), json.dumps(value)).encode()


def _fields(schema) -> list[str]:
    return sorted(set(schema.__struct_fields__) | {"unknown_field"})


def _check_answer(status: int, raw) -> dict | None:
    """No 5xx; a 4xx is OpenAI's envelope (returned); a stream carries no server error."""
    assert status < 500, (status, raw)
    if status >= 400:
        return _assert_openai_error(status, raw)
    if isinstance(raw, str):  # a stream
        assert '"server_error"' not in raw, raw
    return None


def _fuzz(server, path: str, base: dict, mutations: dict) -> None:
    status, raw = _post(server, path, _body({**base, **mutations}))
    error = _check_answer(status, raw)
    if error is not None and len(mutations) == 1:  # one field changed: the refusal names a field
        assert error["param"] is not None, (mutations, error)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_fuzzed_request_fields_never_get_a_5xx(server, route):
    from pagoda.api_proc.openai_schema import ChatCompletionRequest, CompletionRequest

    path, base, schema = {
        "completions": ("/v1/completions", _completion(), CompletionRequest),
        "chat": ("/v1/chat/completions", _chat(), ChatCompletionRequest),
    }[route]

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.dictionaries(st.sampled_from(_fields(schema)), JSON_VALUES, min_size=1, max_size=3))
    def check(mutations):
        _fuzz(server, path, base, mutations)

    check()
    assert _post(server, path, base)[0] == 200  # and the server still serves


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(JSON_VALUES)
def test_fuzzed_whole_bodies_never_get_a_5xx(server, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        status, raw = _post(server, path, _body(body))
        _check_answer(status, raw)
