"""The direct ZeroMQ clients against a real server: same results and same checks as HTTP."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api_proc.bench.local_server import MODEL_NAME, wait_until
from pagoda.api_proc.client import AsyncEngineClient, EngineClient, EngineError
from pagoda.engine_core import protocol
from pagoda.engine_core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0)


@pytest.fixture()
def direct(server):
    """An EngineClient on the module's server (`client`, from conftest.py, is the OpenAI SDK on it)."""
    direct = EngineClient(server.frontend)
    yield direct
    direct.close()


def _collect(deltas) -> tuple[str, list[int], list[protocol.GenerateDelta]]:
    deltas = list(deltas)
    tokens = [t for d in deltas for t in protocol.unpack_tokens(d.tokens)]
    return "".join(d.text for d in deltas), tokens, deltas


def _still_serves(direct: EngineClient) -> None:
    """A request after the one under test gets its two tokens, ended by max_tokens."""
    _, tokens, deltas = _collect(
        direct.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True), timeout=30)
    )
    assert len(tokens) == 2 and deltas[-1].finish_reason == "length"


def test_token_ids_equal_the_offline_engine(direct, default_model_dir):
    from pagoda.engine_core.llm import LLM

    prompts = ["The capital of Italy is", "def fibonacci(n):"]
    offline = LLM(str(default_model_dir), kv_cache_memory="128MiB").generate(prompts, GREEDY, use_tqdm=False)
    for prompt, expected in zip(prompts, offline, strict=True):
        text, tokens, deltas = _collect(direct.generate(prompt, GREEDY, timeout=60))
        assert tokens == expected.outputs[0].token_ids and text == expected.outputs[0].text
        assert deltas[-1].num_output_tokens == len(tokens)
        assert deltas[-1].num_prompt_tokens == len(expected.prompt_token_ids)


def test_chat_and_token_prompts_match_http(direct, client, tokenizer):
    messages = [{"role": "user", "content": "Give me one word for happy."}]
    expected = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    text, _, _ = _collect(direct.generate(messages=messages, params=GREEDY, timeout=60))
    assert text == expected.choices[0].message.content
    ids = tokenizer.encode("The capital of Italy is")
    by_ids, _, _ = _collect(direct.generate(prompt_token_ids=ids, params=GREEDY, timeout=60))
    by_text, _, _ = _collect(direct.generate("The capital of Italy is", GREEDY, timeout=60))
    assert by_ids == by_text


def test_same_validation_as_http(direct):
    with pytest.raises(EngineError) as info:
        list(direct.generate("hello", SamplingParams(max_tokens=10**6), timeout=30))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(EngineError) as info:
        list(direct.generate(prompt_token_ids=[1, 10**8], params=GREEDY, timeout=30))
    assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        list(direct.generate("a", GREEDY, messages=[{"role": "user", "content": "b"}]))
    _still_serves(direct)


def test_leaving_early_aborts_and_n2(direct):
    stream = direct.generate("Once upon a time", SamplingParams(max_tokens=1000, ignore_eos=True), timeout=30)
    next(stream)
    stream.close()  # leaves the generator: the request is aborted
    assert wait_until(lambda: direct.health().num_running == 0, 5.0)
    _, _, deltas = _collect(direct.generate("Pick a color:", SamplingParams(n=2, max_tokens=5, seed=3), timeout=30))
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1]


def test_async_client_runs_requests_concurrently(server, direct):
    prompts = [f"List {i} animals:" for i in range(8)]
    expected = [_collect(direct.generate(p, GREEDY, timeout=60))[1] for p in prompts]

    async def run() -> list[list[int]]:
        aclient = AsyncEngineClient(server.frontend)

        async def one(prompt: str) -> list[int]:
            return [t async for d in aclient.generate(prompt, GREEDY) for t in protocol.unpack_tokens(d.tokens)]

        try:
            health = await aclient.health()
            assert health.healthy and health.max_model_len > 0
            tokens = protocol.unpack_tokens((await aclient.tokenize("héllo")).tokens)
            assert await aclient.detokenize(tokens) == "héllo"
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            aclient.close()

    assert asyncio.run(run()) == expected


def _aborted(direct: EngineClient) -> float:
    """vllm:request_success{finished_reason="abort"}: samples ended by their client's abort."""
    text = direct.metrics().decode()
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort"
    )


def test_leaving_early_or_a_timeout_aborts_the_request(direct):
    # The abort leaves on the client's socket before the metrics query, and the tokenizer process
    # handles one client's messages in order: no waiting needed.
    before = _aborted(direct)
    stream = direct.generate("Once upon a time", SamplingParams(max_tokens=1000, ignore_eos=True), timeout=30)
    next(stream)
    stream.close()
    assert _aborted(direct) == before + 1
    with pytest.raises(TimeoutError):  # no first delta comes within a millisecond: the prefill alone takes longer
        next(direct.generate("Once upon a time", SamplingParams(max_tokens=1000, ignore_eos=True), timeout=0.001))
    assert _aborted(direct) == before + 2
    _still_serves(direct)


def test_a_malformed_frame_fails_one_request_not_the_server(server, direct):
    async def send_malformed() -> EngineError | None:
        aclient = AsyncEngineClient(server.frontend)
        try:
            await aclient._call(protocol.DetokenizeRequest("broken", b"abc"), 10)  # not int32s
        except EngineError as exc:
            return exc
        finally:
            await aclient.aclose()

    error = asyncio.run(send_malformed())
    assert isinstance(error, EngineError) and error.status == 500
    assert direct.health().healthy
    _still_serves(direct)
