"""/v1/embeddings and /pooling on a real `pagoda serve` of the default embedding model (all-MiniLM-L6-v2),
through the official `openai` SDK and the direct client, against sentence-transformers' `encode`."""

from __future__ import annotations

import base64
import random

import numpy as np
import openai
import pytest

from pagoda.api_proc.bench.local_server import http
from pagoda.api_proc.client import EngineClient, EngineError
from pagoda.engine_core.default_embedding_model import ensure_default_embedding_model
from tests.metrics_scrape import Scrape, delta

st = pytest.importorskip("sentence_transformers")

WORDS = (
    "the quick brown fox jumps over lazy dog embeddings are vectors that capture meaning of text "
    "server batching tokens model café naïve Größe señor façade résumé"
).split()
SPECIAL = [
    " ",
    ".",
    "a",
    "?!",
    "Hello world",
    "Ça va? Très bien, merci.",
    "東京は日本の首都です。",
    "我喜欢用中文写句子。",
    "한국어 문장입니다",
    "emoji only 🎉🚀🔥",
    "mixed: naïve café 北京 🙂 – ok",
    "Ελληνικά και русский текст",
]


def sentences(tokenizer) -> list[str]:
    """50 inputs of 1 to 256 tokens: punctuation and one-letter ones, accents, CJK, emoji, and word runs
    up to the model's 256-token limit ([CLS] and [SEP] included)."""
    rng = random.Random(7)
    texts = list(SPECIAL)
    lengths = [2, 5, 9, 14, 20, 30, 45, 60, 80, 100, 120, 150, 180, 200, 220, 240, 300]
    while len(texts) < 50:
        words = [rng.choice(WORDS) for _ in range(lengths[len(texts) % len(lengths)])]
        while len(tokenizer(" ".join(words))["input_ids"]) > 256:
            words.pop()
        texts.append(" ".join(words))
    return texts


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_embedding_model()


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server("--model", str(model_dir), "--max-batch-inputs", "64")


@pytest.fixture(scope="module")
def limited(start_server, model_dir):
    """Steps of two of the longest inputs, and low caps on one request's tokens and per-token values."""
    return start_server(
        "--model",
        str(model_dir),
        "--max-num-batched-tokens",
        "512",
        "--max-batch-tokens",
        "4096",
        "--max-token-embed-values",
        "200000",
    )


LONGEST = [101, *range(2000, 2254), 102]  # 256 token ids: the model's longest input


@pytest.fixture(scope="module")
def reference(model_dir):
    return st.SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embeddings_match_sentence_transformers(client, model_name, reference):
    texts = sentences(reference.tokenizer)
    lengths = [len(ids) for ids in reference.tokenizer(texts)["input_ids"]]
    assert min(lengths) == 2 and max(lengths) == 256  # [CLS] + [SEP] + 0..254 tokens
    expected = reference.encode(texts, convert_to_numpy=True)
    batched = client.embeddings.create(model=model_name, input=texts)  # (the SDK asks for base64 and decodes it)
    ours = np.array([d.embedding for d in batched.data])
    assert [d.index for d in batched.data] == list(range(50))
    assert cosine(ours, expected).min() >= 0.9999
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == sum(lengths)
    single = [client.embeddings.create(model=model_name, input=t, encoding_format="float") for t in texts[:12]]
    alone = np.array([s.data[0].embedding for s in single])
    np.testing.assert_allclose(alone, ours[:12], atol=2e-6)  # batching does not change a result


def test_base64_is_the_float32_bytes_of_the_float_result(client, model_name):
    texts = ["base64 please", "Ünïcödé 🙂"]
    floats = client.embeddings.create(model=model_name, input=texts, encoding_format="float")
    packed = client.embeddings.create(model=model_name, input=texts, encoding_format="base64")
    for f, b in zip(floats.data, packed.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(f.embedding, dtype=np.float32))


def test_token_id_inputs_and_truncation(client, model_name, reference):
    ids = reference.tokenizer("token ids work too")["input_ids"]
    by_text = client.embeddings.create(model=model_name, input="token ids work too", encoding_format="float")
    by_ids = client.embeddings.create(model=model_name, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)
    raw = client.embeddings.create(
        model=model_name,
        input="token ids work too",
        user="u-1",
        encoding_format="float",
        extra_body={"normalize": False},
    )
    norm = np.linalg.norm(raw.data[0].embedding)
    assert abs(norm - 1) > 0.01  # the model's Normalize module skipped: the same direction, its own length
    np.testing.assert_allclose(np.array(raw.data[0].embedding) / norm, by_text.data[0].embedding, atol=1e-6)
    long = "word " * 400
    truncated = client.embeddings.create(
        model=model_name, input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": 256}
    )
    expected = reference.encode([long])  # sentence-transformers truncates at 256 tokens too
    assert cosine(np.array(truncated.data[0].embedding), expected[0]) >= 0.9999
    assert truncated.usage.prompt_tokens == 256


def test_dimensions_is_refused_for_a_model_without_matryoshka(client, model_name):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=model_name, input="hello", dimensions=128)
    assert refused.value.body["param"] == "dimensions"
    assert "Matryoshka" in refused.value.body["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": []}, "input"),
        ({"input": ["x"] * 10_000}, "input"),  # beyond --max-batch-inputs 64
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [[1, 2], [-1]]}, "input"),
        ({"input": [[10**6]]}, "input"),
        ({"input": "word " * 300}, "input"),  # 302 tokens: over 256
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
        ({"input": "x", "dimensions": "big"}, "dimensions"),
    ],
)
def test_bad_input_is_refused_naming_the_field(server, body, param):
    status, answer = http("POST", server.base_url + "/v1/embeddings", body=body)
    assert 400 <= status < 500, answer
    assert answer["error"]["param"] == param or param in answer["error"]["message"], answer
    status, ok = http("POST", server.base_url + "/v1/embeddings", body={"input": "still serving"})
    assert status == 200 and len(ok["data"][0]["embedding"]) == 384


def test_overlong_input_names_both_numbers(server):
    status, answer = http("POST", server.base_url + "/v1/embeddings", body={"input": ["ok", "word " * 300]})
    assert status == 400
    assert "302 tokens" in answer["error"]["message"] and "256 tokens" in answer["error"]["message"]
    assert answer["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("route", ["/v1/embeddings", "/pooling"])
def test_an_input_without_tokens_is_refused_as_empty(server, route):
    """An empty text without special tokens has no token at all: a 400 saying so, not a length error."""
    for body, where in (({"input": ""}, "'input'"), ({"input": ["ok", ""]}, "'input[1]'")):
        status, answer = http("POST", server.base_url + route, body={**body, "add_special_tokens": False})
        assert status == 400 and answer["error"]["param"] == "input", answer
        assert answer["error"]["code"] == "empty_input" and answer["error"]["type"] == "invalid_request_error"
        assert f"Invalid {where}: the input is empty" in answer["error"]["message"], answer


def test_generation_routes_are_refused_by_an_embedding_model(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
        status, answer = http("POST", server.base_url + route, body=body)
        assert status == 400 and "embedding model" in answer["error"]["message"], answer


def test_pooling_route_gives_token_vectors_and_embeddings(server, reference):
    text = "pooling returns every token"
    status, tokens = http("POST", server.base_url + "/pooling", body={"input": [text]})
    assert status == 200 and tokens["data"][0]["object"] == "pooling"
    rows = np.array(tokens["data"][0]["data"])
    expected = reference.encode([text], output_value="token_embeddings")[0].numpy()
    assert rows.shape == expected.shape
    assert cosine(rows, expected).min() >= 0.9999
    status, pooled = http("POST", server.base_url + "/pooling", body={"input": text, "task": "embed"})
    assert status == 200 and cosine(np.array(pooled["data"][0]["data"]), reference.encode([text])[0]) >= 0.9999


def test_base64_token_vectors_are_the_float32_bytes_of_the_rows(server):
    body = {"input": [LONGEST[:40], LONGEST[:7]]}
    status, floats = http("POST", server.base_url + "/pooling", body=body)
    assert status == 200
    status, packed = http("POST", server.base_url + "/pooling", body={**body, "encoding_format": "base64"})
    assert status == 200 and packed["usage"] == floats["usage"]
    for f, b in zip(floats["data"], packed["data"], strict=True):
        rows = np.frombuffer(base64.b64decode(b["data"]), dtype="<f4").reshape(-1, 384)  # (the hidden size)
        assert np.array_equal(rows, np.asarray(f["data"], dtype=np.float32))


def test_per_token_output_over_the_values_cap_is_refused_naming_the_flag(limited):
    over = {"input": [LONGEST[:200]] * 3}  # 600 tokens x 384 dimensions = 230,400 values > 200,000
    status, answer = http("POST", limited.base_url + "/pooling", body=over)
    assert status == 400, answer
    assert "--max-token-embed-values" in answer["error"]["message"] and "230,400" in answer["error"]["message"]
    assert answer["error"]["code"] == "too_many_values" and answer["error"]["param"] == "input"
    status, pooled = http("POST", limited.base_url + "/pooling", body={**over, "task": "embed"})  # one vector each
    assert status == 200 and len(pooled["data"]) == 3
    status, rows = http("POST", limited.base_url + "/pooling", body={"input": [LONGEST[:200]] * 2})
    assert status == 200 and len(rows["data"][1]["data"]) == 200


def test_a_request_over_the_token_cap_is_refused_naming_the_flag(limited):
    for route in ("/v1/embeddings", "/pooling"):
        status, answer = http("POST", limited.base_url + route, body={"input": [LONGEST] * 17})
        assert status == 400, answer  # 17 x 256 = 4,352 tokens > 4,096
        assert "--max-batch-tokens" in answer["error"]["message"] and "4,352" in answer["error"]["message"]
        assert answer["error"]["code"] == "too_many_tokens" and answer["error"]["param"] == "input"
    status, ok = http("POST", limited.base_url + "/v1/embeddings", body={"input": [LONGEST] * 16})
    assert status == 200 and len(ok["data"]) == 16


def test_a_small_request_is_not_queued_behind_a_large_one(limited):
    """A one-sentence request sent after a 16-input one (eight steps of two inputs) is answered first: it
    runs in the large request's first step, instead of after all of its inputs."""
    import os
    import signal
    import threading
    import time

    finished: list[str] = []

    def post(name: str, inputs: list) -> None:
        status, _ = http("POST", limited.base_url + "/v1/embeddings", body={"input": inputs}, timeout=120)
        assert status == 200
        finished.append(name)

    engine = limited.child_named("pagoda-engine")
    os.kill(engine, signal.SIGSTOP)  # (so both requests wait in the engine's input queue, the large one first)
    try:
        large = threading.Thread(target=post, args=("large", [LONGEST] * 16))
        large.start()
        time.sleep(0.5)
        small = threading.Thread(target=post, args=("small", ["one sentence"]))
        small.start()
        time.sleep(0.5)
    finally:
        os.kill(engine, signal.SIGCONT)
    large.join(120)
    small.join(120)
    assert finished == ["small", "large"]


def test_direct_client_embed(server, reference):
    client = EngineClient(server.frontend)
    try:
        result = client.embed(["direct", "client"], timeout=60)
        assert cosine(result.embeddings(), reference.encode(["direct", "client"])).min() >= 0.9999
        with pytest.raises(EngineError) as refused:
            client.embed([], timeout=60)
        assert refused.value.param == "input"
    finally:
        client.close()


def test_metrics_count_pooling_requests(server):
    before = Scrape(server)
    status, _ = http("POST", server.base_url + "/v1/embeddings", body={"input": ["one", "two", "three"]})
    assert status == 200
    after = Scrape(server)
    assert delta(before, after, "pagoda:pooling_requests_total", task="embed") == 3
    assert delta(before, after, "vllm:request_success_total", finished_reason="stop") == 3
    assert delta(before, after, "vllm:prompt_tokens_total") == 9  # [CLS] word [SEP] each


def test_public_metrics_name_the_model_without_its_path(server, model_dir, model_name):
    """Served from a local directory without --served-model-name: /v1/models (behind the key when there
    is one) lists the path as given, the public /metrics only the directory's name."""
    assert model_name == str(model_dir)
    status, text = http("GET", server.base_url + "/metrics")
    assert status == 200 and str(model_dir) not in text and str(model_dir.parent) not in text
    labelled = [s for s in Scrape(server).samples if "model_name" in s.labels]
    assert labelled and {s.labels["model_name"] for s in labelled} == {model_dir.name}


def test_engine_death_fails_an_embedding_request_without_a_hang(tmp_path, model_dir):
    import os
    import signal
    import threading
    import time

    from pagoda.api_proc.bench.local_server import PagodaServer

    server = PagodaServer(tmp_path, "--model", str(model_dir))
    engine = server.child_named("pagoda-engine")
    outcome: dict = {}
    os.kill(engine, signal.SIGSTOP)  # the request then surely waits in the engine when it dies
    thread = threading.Thread(
        target=lambda: outcome.update(answer=http("POST", server.base_url + "/v1/embeddings", {"input": ["x"] * 8}))
    )
    thread.start()
    time.sleep(1.0)
    os.kill(engine, signal.SIGKILL)
    assert server.process.wait(15) != 0
    thread.join(15)
    assert not thread.is_alive()
    status, body = outcome["answer"]
    assert status >= 500 and body["error"]["type"] == "server_error"  # an error, never a hang or a 200
    server.stop()
