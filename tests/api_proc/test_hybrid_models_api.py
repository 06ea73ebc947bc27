"""The hybrid families served over HTTP through the OpenAI SDK: a tiny Qwen3.5 (recurrent state pool) and a
tiny Gemma 3 (sliding and full KV groups), each with SmolLM2's tokenizer beside it. Streamed and whole
completions carry the same text, concurrent requests each get their own state, and /metrics shows the
recurrent state pool beside the KV pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests import tiny_models
from tests.metrics_scrape import scrape_until


@pytest.fixture(scope="module", params=["qwen3_5", "gemma3"])
def served(request, start_server, tmp_path_factory, default_model_dir):
    out = tmp_path_factory.mktemp(request.param)
    tiny_models.save_servable(request.param, out, default_model_dir)
    server = start_server("--model", str(out), "--served-model-name", "tiny", "--max-num-seqs", "4")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return request.param, server, client


def _complete(client, prompt: str, stream: bool = False) -> str:
    params = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    if not stream:
        return client.completions.create(**params).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **params))


def test_streamed_whole_and_concurrent_completions_agree(served):
    _, _, client = served
    prompts = ["The cache of a hybrid model", "Sliding windows", "A recurrent state per sequence", "Hello"]
    alone = [_complete(client, p) for p in prompts]
    assert all(alone)
    assert _complete(client, prompts[0], stream=True) == alone[0]
    with ThreadPoolExecutor(4) as pool:  # (together: each its own state slot and block tables)
        assert list(pool.map(lambda p: _complete(client, p), prompts * 2)) == alone * 2


def test_metrics_show_the_recurrent_state_pool(served):
    family, server, client = served
    _complete(client, "Hello")
    scrape = scrape_until(server, lambda s: s.value("vllm:num_requests_running") == 0)
    has_pool = "pagoda:recurrent_state_usage_perc" in scrape.families
    assert has_pool == (family == "qwen3_5")
    if has_pool:
        assert scrape.value("pagoda:recurrent_state_usage_perc") == 0.0  # (idle: every slot back)
    assert "vllm:kv_cache_usage_perc" in scrape.families  # (beside the KV pool's)
