"""No sampling parameter takes the server down: extreme floats through HTTP are answered (greedy below the
temperature threshold, or a 400 in OpenAI's shape), and a request whose logits are not finite fails alone
with a 500 while the engine goes on serving the others. After every case the server is healthy with the
same processes."""

from __future__ import annotations

import json
import math
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, http
from tests import tiny_models

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _next_up(x: float) -> float:
    return math.nextafter(x, math.inf)


def _next_down(x: float) -> float:
    return math.nextafter(x, -math.inf)


F32_MAX = _f32(3.4e38)
# Numbers as JSON texts: subnormals, signed zeros, float32's rounding edges, the ranges' bounds and their
# neighbours, values that overflow float32 or float64 (1e400 is infinity to a JSON reader), and the
# non-JSON literals NaN and Infinity that some clients (Python's json) still write.
EDGE_TEXTS = [
    "0",
    "0.0",
    "-0.0",
    "5e-324",
    "-5e-324",
    "1e-45",
    "-1e-45",
    "7e-46",
    repr(_f32(1e-45)),
    "1e-40",
    "1e-38",
    repr(_f32(1.1754943508222875e-38)),
    "1e-50",
    repr(_next_down(1e-5)),
    "1e-05",
    repr(_next_up(1e-5)),
    repr(_next_down(1.0)),
    "1",
    repr(_next_up(1.0)),
    "2",
    repr(_next_up(2.0)),
    "-2",
    repr(_next_down(-2.0)),
    "0.01",
    repr(_next_down(0.01)),
    "100",
    repr(_next_up(100.0)),
    "10000",
    repr(_next_up(10000.0)),
    repr(F32_MAX),
    repr(_next_up(F32_MAX)),
    "3.4028235677973366e+38",
    "1e308",
    "1.7976931348623157e308",
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    "12",
]


def _number_text(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


NUMBERS = st.sampled_from(EDGE_TEXTS) | st.floats(width=64).map(_number_text) | st.floats(width=32).map(_number_text)
# A float field, or a logit_bias value (on a token the prompt makes likely), with its number as JSON text.
FIELDS = st.sampled_from([*FLOAT_FIELDS, "logit_bias"])


def _body_text(base: dict, numbers: dict[str, str]) -> bytes:
    """`base` as JSON with each field of `numbers` written as its raw number text."""
    parts = [json.dumps(base)[:-1]]
    for field, text in numbers.items():
        value = f'{{"{PARIS}": {text}}}' if field == "logit_bias" else text
        parts.append(f', "{field}": {value}')
    return ("".join(parts) + "}").encode()


PARIS = 7042  # a token id of SmolLM2's vocabulary


def _processes(server: PagodaServer) -> tuple[int, list[int]]:
    return server.process.pid, sorted(server.children())


def _assert_serving(server: PagodaServer, processes) -> None:
    status, body = http("GET", server.base_url + "/health", timeout=30)
    assert status == 200, body
    assert server.process.poll() is None and _processes(server) == processes


def _assert_openai_error(status: int, body) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert "Error:" not in error["message"] and "Traceback" not in error["message"], error  # no internal text
    return error


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-tokens-cap", "8")


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 3, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3, **fields}


ROUTES = {"completions": ("/v1/completions", _completion), "chat": ("/v1/chat/completions", _chat)}


def _text(route: str, body: dict) -> str:
    return body["choices"][0]["text"] if route == "completions" else body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("route", list(ROUTES))
def test_temperatures_too_small_for_float32_decode_greedily(server, route):
    path, make = ROUTES[route]
    processes = _processes(server)
    status, greedy = http("POST", server.base_url + path, make(temperature=0))
    assert status == 200, greedy
    for temperature in (1e-45, 1e-38, 1e-40, 1e-50, 1e-50, 1e-50, 5e-6):
        status, body = http("POST", server.base_url + path, make(temperature=temperature))
        assert status == 200, (temperature, body)
        assert _text(route, body) == _text(route, greedy), temperature
    _assert_serving(server, processes)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_repetition_penalty_that_overflows_float32_is_a_400(server, route):
    path, make = ROUTES[route]
    processes = _processes(server)
    for value in (1e-45, 0.0, 1e300):
        status, body = http("POST", server.base_url + path, make(repetition_penalty=value))
        assert status == 400 and _assert_openai_error(status, body)["param"] == "repetition_penalty", body
    _assert_serving(server, processes)


@pytest.mark.parametrize("route", list(ROUTES))
def test_fuzzed_sampling_numbers_never_take_the_server_down(server, route):
    path, make = ROUTES[route]
    processes = _processes(server)

    @settings(
        max_examples=120 if route == "completions" else 60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.dictionaries(FIELDS, NUMBERS, min_size=1, max_size=3))
    def check(numbers):
        status, body = http("POST", server.base_url + path, _body_text(make(), numbers), timeout=60)
        assert status in (200, 400), (numbers, status, body)
        if status == 400:
            error = _assert_openai_error(status, body)
            if len(numbers) == 1 and error["param"] is not None:
                assert error["param"] == next(iter(numbers)), (numbers, error)
        else:
            assert body["choices"][0]["finish_reason"] in ("stop", "length"), (numbers, body)
        _assert_serving(server, processes)

    check()


# ---- a model whose logits are NaN for some prompts ----------------------------------------------------

POISON = 1000  # the token whose embedding row is NaN


@pytest.fixture(scope="module")
def nan_server(tmp_path_factory, default_model_dir, start_server):
    """A tiny model (untied, so that only its input embedding is poisoned) whose embedding of POISON is NaN:
    a prompt holding it has NaN hidden states from there on, and NaN logits."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan-model")
    vocab_size = json.loads((Path(default_model_dir) / "config.json").read_text())["vocab_size"]
    tiny_models.build("llama", vocab_size=vocab_size).save_pretrained(out)
    for file in tiny_models.SERVABLE_FILES:
        shutil.copy(Path(default_model_dir) / file, out / file)
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = math.nan
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return start_server("--model", str(out), "--served-model-name", MODEL_NAME, "--max-num-seqs", "16")


def _tokens(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}


GOOD = [5, 6, 7, 8, 9] * 6
BAD = [5, 6, POISON, 7, 8]


def test_a_request_with_nan_logits_fails_alone_and_the_engine_serves_on(nan_server):
    url = nan_server.base_url + "/v1/completions"
    processes = _processes(nan_server)
    status, alone = http("POST", url, _tokens(prompt=GOOD))
    assert status == 200, alone

    def send(body):
        return http("POST", url, body, timeout=120)

    # (body, whether it fails): a batch of two prompts with one poisoned fails whole, as any request does
    cases = [
        (_tokens(prompt=BAD), True),
        (_tokens(prompt=GOOD), False),
        (_tokens(prompt=BAD, temperature=0.9, n=2), True),
    ]
    cases += [(_tokens(prompt=GOOD, max_tokens=4 + i), False) for i in range(3)] + [(_tokens(prompt=[BAD, GOOD]), True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(send, [body for body, _ in cases]))
    for (_, fails), (status, answer) in zip(cases, answers, strict=True):
        if fails:
            assert status == 500, answer
            error = _assert_openai_error(status, answer)
            assert error["type"] == "server_error" and error["code"] == "request_failed", error
            assert "not finite" in error["message"], error
        else:
            assert status == 200, answer
            text = answer["choices"][0]["text"]
            assert alone["choices"][0]["text"].startswith(text), (text, alone)
    # The failed requests' KV blocks went back to the pool, and are reused without harm.
    status, again = http("POST", url, _tokens(prompt=GOOD))
    assert status == 200 and again["choices"][0]["text"] == alone["choices"][0]["text"], again
    _assert_serving(nan_server, processes)


def test_a_streamed_request_with_nan_logits_ends_in_an_error_event(nan_server):
    client = openai.OpenAI(base_url=nan_server.base_url + "/v1", api_key="unused", max_retries=0)
    processes = _processes(nan_server)
    with pytest.raises(openai.APIError) as error:
        for _ in client.completions.create(model=MODEL_NAME, prompt=BAD, max_tokens=4, stream=True):
            pass
    assert "not finite" in str(error.value)
    chat = client.completions.create(model=MODEL_NAME, prompt=GOOD, max_tokens=3, temperature=0)
    assert chat.choices[0].finish_reason == "length"
    _assert_serving(nan_server, processes)
