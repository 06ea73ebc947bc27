"""vLLM's `prompt_logprobs` through a real `pagoda serve`: the official `openai` SDK (completions and chat,
whole and streamed, with echo) and the direct ZeroMQ client, checked against HF transformers' float32
log-softmax of the same prompt."""

from __future__ import annotations

import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from pagoda.api_proc.client import EngineClient
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.tokenizer import encode_chat
from tests.helpers import assert_prompt_logprobs_match, hf_prompt_logprobs

TEXT = "The committee met on Tuesday to review the budget. After a long debate about road repairs, the members"
OTHER = "Mountains form when tectonic plates collide over millions of years."
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


def _shown(prompt_logprobs: list) -> list:
    """The JSON form (string token ids -> {"logprob", "rank", "decoded_token"}) as (logprob, rank) by id."""
    return [None if e is None else {int(t): (v["logprob"], v["rank"]) for t, v in e.items()} for e in prompt_logprobs]


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    def reference(ids: list[int]):
        return hf_prompt_logprobs(hf_model, ids)

    return reference


def test_completions_per_prompt_and_choice(client, tokenizer, reference):
    response = client.completions.create(
        model=MODEL_NAME, prompt=[TEXT, OTHER], n=2, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:  # every choice shows its prompt's (vLLM's shape)
        ids = tokenizer.encode(TEXT if choice.index < 2 else OTHER)
        assert_prompt_logprobs_match(_shown(choice.prompt_logprobs), ids, reference(ids), 3)
        entry = choice.prompt_logprobs[1][str(ids[1])]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert entry["decoded_token"] == tokenizer.decode(ids[1:2])
    plain = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra  # only when asked for
    assert plain.choices[0].text == response.choices[0].text


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, tokenizer, reference):
    ids = tokenizer.encode(TEXT)
    kwargs = dict(model=MODEL_NAME, prompt=TEXT, max_tokens=3, temperature=0, logprobs=2)
    generated = client.completions.create(**kwargs).choices[0]
    echoed = client.completions.create(**kwargs, echo=True).choices[0]
    assert echoed.text == TEXT + generated.text
    logprobs, ref = echoed.logprobs, reference(ids)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids] + generated.logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing before it
    for i in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
        assert logprobs.tokens[i] in logprobs.top_logprobs[i] and len(logprobs.top_logprobs[i]) in (2, 3)
    # The same tokens; their logprobs agree to rounding only, since the echoed request's prompt may be
    # computed by another kernel (prefix cache hit or not) than the first request's.
    assert logprobs.tokens[len(ids) :] == generated.logprobs.tokens
    assert logprobs.token_logprobs[len(ids) :] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-4)
    assert logprobs.text_offset[len(ids)] == len(TEXT)  # the generated tokens' offsets follow the prompt
    assert echoed.model_extra["prompt_logprobs"] is not None  # echo with logprobs implies them, as in vLLM

    # Streamed with n=2: each choice's first chunk starts with the prompt's tokens and their logprobs.
    chunks = list(client.completions.create(**kwargs, echo=True, n=2, stream=True))
    for index in (0, 1):
        first = next(c.choices[0] for c in chunks if c.choices[0].index == index)
        assert first.logprobs.tokens[: len(ids)] == logprobs.tokens[: len(ids)]
        assert first.logprobs.token_logprobs[: len(ids)] == logprobs.token_logprobs[: len(ids)]


def test_streamed_completion_carries_them_in_the_first_chunk_of_choice_0(client):
    kwargs = dict(model=MODEL_NAME, prompt=TEXT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1})
    whole = client.completions.create(**kwargs).choices[0].prompt_logprobs
    chunks = list(client.completions.create(**kwargs, n=2, stream=True))
    carrying = [i for i, c in enumerate(chunks) if c.choices[0].model_extra.get("prompt_logprobs") is not None]
    assert len(carrying) == 1
    first_of_0 = next(i for i, c in enumerate(chunks) if c.choices[0].index == 0)
    assert carrying == [first_of_0] and chunks[first_of_0].choices[0].prompt_logprobs == whole


def test_chat_has_one_list_beside_the_choices(client, tokenizer, reference):
    ids = encode_chat(tokenizer, CHAT)
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    response = client.chat.completions.create(**kwargs, n=2)
    assert response.usage.prompt_tokens == len(ids)
    assert_prompt_logprobs_match(_shown(response.prompt_logprobs), ids, reference(ids), 2)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].model_extra["prompt_logprobs"] == response.prompt_logprobs
    assert all("prompt_logprobs" not in c.model_extra for c in chunks[1:])


def test_out_of_range_or_ill_typed_is_refused(server):
    for route, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ):
        for value in (21, -1, "3"):
            status, answer = http("POST", server.base_url + route, {**body, "prompt_logprobs": value})
            assert status == 400 and answer["error"]["param"] == "prompt_logprobs", (route, value, answer)


def test_direct_client_gets_them_decoded_with_its_first_delta(server, client, tokenizer, reference):
    ids = tokenizer.encode(TEXT)
    direct = EngineClient(server.frontend)
    try:
        deltas = list(direct.generate(TEXT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3), timeout=60))
    finally:
        direct.close()
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    shown = deltas[0].prompt_logprobs.by_position(lambda logprob, rank, text: (logprob, rank))
    assert_prompt_logprobs_match(shown, ids, reference(ids), 3)
    over_http = client.completions.create(
        model=MODEL_NAME, prompt=TEXT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    assert shown == _shown(over_http.choices[0].prompt_logprobs)
