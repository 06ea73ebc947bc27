"""The OpenAI API of a real `pagoda serve` on SmolLM2, through the official `openai` SDK."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from pagoda.engine_core.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(default_model_dir):
    from pagoda.engine_core.llm import LLM

    return LLM(str(default_model_dir), kv_cache_memory="256MiB")


def test_completion_greedy_equals_offline_engine_token_for_token(client, offline, tokenizer):
    prompt = "The three primary colors are"
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=0)
    expected = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
    choice = response.choices[0]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert choice.text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.model == MODEL_NAME and response.created > 0


def test_chat_greedy_equals_offline_and_streaming_concatenates_to_it(client, offline, tokenizer):
    expected = offline.chat(CHAT, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [response.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == response.usage.total_tokens


def test_default_max_tokens_chat_is_the_context_and_completion_is_16(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, messages=[{"role": "user", "content": "Write a paragraph about the sea."}]
    )
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens > 16  # ended by EOS


def test_n2_seed_reproducible_and_samples_differ(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=1234,
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in second.choices]
    tokens = client.completions.create(
        model=MODEL_NAME, prompt="Random words:", max_tokens=16, temperature=1.0, n=2, seed=7, logprobs=0
    )
    assert tokens.choices[0].logprobs.tokens != tokens.choices[1].logprobs.tokens
    assert tokens.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in tokens.choices)


def test_prompt_forms_and_echo(client, tokenizer):
    ids = tokenizer.encode("The sky is")
    by_text = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    several = client.completions.create(
        model=MODEL_NAME, prompt=["The sky is", "Water is"], max_tokens=5, temperature=0
    )
    id_lists = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == several.choices[0].text
    assert [c.text for c in id_lists.choices] == [by_text.choices[0].text] * 2
    assert [c.index for c in several.choices] == [0, 1]
    assert several.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Water is"))
    echoed = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky is" + by_text.choices[0].text


def test_stop_strings_over_several_tokens(client):
    base = client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two, three, four,", max_tokens=20, temperature=0
    )
    text = base.choices[0].text
    stop = text[4:11]  # seven characters from the middle of the text: several tokens long
    stopped = client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two, three, four,", max_tokens=20, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop
    kept = client.completions.create(
        model=MODEL_NAME,
        prompt="Count: one, two, three, four,",
        max_tokens=20,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two, three, four,", max_tokens=20, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_logprobs_shapes(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best one
        assert bytes(entry.bytes).decode() == entry.token
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == completion.choices[0].text


def test_extra_sampling_parameters_are_applied(client, tokenizer):
    plain = client.completions.create(
        model=MODEL_NAME, prompt="My favourite animal is the", max_tokens=3, temperature=0, logprobs=0
    )
    banned = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(plain.choices[0].logprobs.tokens[0]))[0]
    biased = client.completions.create(
        model=MODEL_NAME,
        prompt="My favourite animal is the",
        max_tokens=3,
        temperature=0,
        logprobs=0,
        logit_bias={str(banned): -100},
    )
    assert biased.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=6,
        temperature=0,
        extra_body={
            "min_tokens": 6,
            "top_k": 1,
            "repetition_penalty": 1.3,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
        },
    )
    assert forced.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        (b"{not json", 400, None, None),
        ({"model": MODEL_NAME}, 400, "prompt", "missing_required_parameter"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
        ({"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400, "temperature", None),
        ({"model": MODEL_NAME, "prompt": "x", "n": 500}, 400, "n", "integer_above_max_value"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "integer_below_min_value"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**6}, 400, "prompt", "context_length_exceeded"),
        ({"model": MODEL_NAME, "prompt": [1, 2, 10**7]}, 400, "prompt", None),
        ({"model": MODEL_NAME, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ],
)
def test_errors_have_openai_shape_and_status(server, body, status, param, code):
    got_status, got = http("POST", server.base_url + "/v1/completions", body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["message"]
    assert got["error"]["param"] == param and got["error"]["code"] == code
    assert got["error"]["type"] == "invalid_request_error"


def test_chat_errors_and_server_still_serves(client, server):
    status, body = http(
        "POST",
        server.base_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 10},
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    _, models = http("GET", server.base_url + "/v1/models")
    context = models["data"][0]["max_model_len"]  # the KV pool of this test server caps it below 8192
    assert f"maximum context length is {context} tokens" in body["error"]["message"]
    assert "(9031 in the prompt, 10 for the completion)" in body["error"]["message"]
    status, body = http(
        "POST",
        server.base_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 2},
    )
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body = http("POST", server.base_url + "/v1/chat/completions", {"messages": [{"content": "x"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].role"
    status, body = http("GET", server.base_url + "/v1/nothing-here")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = http("POST", server.base_url + "/v1/chat/completions", b"x" * (33 * 1024 * 1024))
    assert status == 413 and "error" in body
    still = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert still.usage.completion_tokens == 3 and still.choices[0].finish_reason == "length"


def test_models_version_tokenize_detokenize(server, tokenizer):
    status, models = http("GET", server.base_url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL_NAME and 0 < models["data"][0]["max_model_len"] <= 8192
    status, version = http("GET", server.base_url + "/version")
    assert status == 200 and version["version"]
    status, tokenized = http("POST", server.base_url + "/tokenize", {"prompt": "Héllo wörld 你好"})
    assert status == 200 and tokenized["tokens"] == tokenizer.encode("Héllo wörld 你好")
    assert tokenized["count"] == len(tokenized["tokens"])
    status, chat = http("POST", server.base_url + "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["tokens"][-3:] == tokenizer.encode("<|im_start|>assistant\n")[-3:]
    status, detok = http("POST", server.base_url + "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and detok["prompt"] == "Héllo wörld 你好"
    status, bad = http("POST", server.base_url + "/detokenize", {"tokens": [-1]})
    assert status == 400 and bad["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    "content",
    [
        "Translate to Japanese: good morning 🌅",
        "Écris une phrase avec des accents: été",
        "用中文回答：天空是什么颜色？",
        "Repeat these emoji: 🐍🚀🎉👩‍💻",
    ],
)
def test_streamed_text_equals_one_shot_for_unicode(client, tokenizer, content):
    messages = [{"role": "user", "content": content}]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=48, temperature=0, logprobs=True
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=48, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed == response.choices[0].message.content
    assert "\ufffd" not in streamed


def test_200_concurrent_streams_none_lost_or_mixed(server):
    async def run() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        prompts = [f"Write the number {i} in words:" for i in range(200)]

        async def one(prompt: str, stream: bool) -> str:
            if not stream:
                r = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
                return r.choices[0].text
            chunks = await aclient.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in chunks])

        streamed = await asyncio.gather(*(one(p, True) for p in prompts))
        single = await asyncio.gather(*(one(p, False) for p in prompts))
        assert streamed == single
        await aclient.close()

    asyncio.run(run())


def test_prefix_cache_over_http_cached_tokens_salt_and_reset(client, server):
    system = "You are a meticulous librarian who answers every question in one short sentence. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where are the maps?"}]
    assert http("POST", server.base_url + "/reset_prefix_cache")[1]["status"] == "ok"
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    salted = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-a"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's cache
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-a"}
    )
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    status, body = http("POST", server.base_url + "/reset_prefix_cache")
    assert status == 200 and body["num_blocks"] > 0
    after = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "n": 2, "seed": 2**64 - 1}, "seed"),
        ({"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
        ({"prompt": [1, 2, 2**40]}, "prompt"),
        ({"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids"),
    ],
)
def test_out_of_range_numbers_are_400_and_harm_nothing(server, client, body, param):
    status, got = http("POST", server.base_url + "/v1/completions", body)
    assert status == 400 and got["error"]["param"] == param, got
    status, got = http("POST", server.base_url + "/tokenize", {"messages": "hi"})
    assert status == 400 and got["error"]["param"] == "messages"
    assert http("GET", server.base_url + "/health")[0] == 200
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_streamed_echo_prefixes_every_choice(client):
    kwargs = {
        "model": MODEL_NAME,
        "prompt": "Hi there",
        "max_tokens": 3,
        "n": 2,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    completion = client.completions.create(**kwargs).choices[0].text  # greedy: both choices are this
    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: "Hi there" + completion, 1: "Hi there" + completion}


def test_embedding_routes_are_refused_by_a_generative_model(client, server):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL_NAME, input="hello")
    assert refused.value.body["param"] == "model" and "not an embedding model" in refused.value.body["message"]
    status, answer = http("POST", server.base_url + "/pooling", body={"input": "hello"})
    assert status == 400 and answer["error"]["code"] == "model_not_embedding"
