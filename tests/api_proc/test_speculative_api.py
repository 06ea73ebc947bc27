"""`pagoda serve --speculative-config` through HTTP and the `openai` SDK: the same greedy text as a server
without speculation, streamed and whole; a streamed chunk carries several tokens when proposals hold
(their logprobs one per token); the vllm:spec_decode_* counters in /metrics agree with each other."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from api_proc.bench.local_server import MODEL_NAME
from tests.metrics_scrape import Scrape, delta

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
PROMPTS = [
    "Repeat the following text exactly, word for word:\n\nThe train to the airport leaves every fifteen minutes "
    "from platform four, and the journey takes twenty-five minutes without stops.",
    "Rename the function in this Python code to `compute` and output the whole code again:\n\n"
    "def average(values):\n    if not values:\n        return 0\n    return sum(values) / len(values)\n",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def servers(start_server):
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(start_server)
        speculating = pool.submit(start_server, "--speculative-config", NGRAM, "--speculative-disable-batch-size", "8")
        return plain.result(), speculating.result()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(server, prompt: str, stream: bool):
    return client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        temperature=0,
        stream=stream,
        logprobs=stream,
    )


def test_greedy_text_equals_the_plain_servers_streamed_and_whole(servers):
    plain, speculating = servers
    for prompt in PROMPTS:
        expected = chat(plain, prompt, stream=False).choices[0].message.content
        assert chat(speculating, prompt, stream=False).choices[0].message.content == expected
        chunks = [c for c in chat(speculating, prompt, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_a_chunk_carries_several_tokens_and_the_counters_agree(servers):
    _, speculating = servers
    before = Scrape(speculating)
    chunks = [c for c in chat(speculating, PROMPTS[0], stream=True) if c.choices]
    tokens_per_chunk = [len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs]
    assert max(tokens_per_chunk) > 1  # proposals held: several tokens in one step, one logprob each
    after = Scrape(speculating)
    drafts = delta(before, after, "vllm:spec_decode_num_drafts_total")
    proposed = delta(before, after, "vllm:spec_decode_num_draft_tokens_total")
    kept = delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = [
        delta(before, after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(4)
    ]
    assert 0 < kept <= proposed <= 4 * drafts
    assert sum(per_position) == kept and per_position == sorted(per_position, reverse=True)
    # Every chunk but the first is one step's tokens: 1 + the proposals kept (fewer in the last step if the
    # end of the text came inside what it kept).
    emitted = sum(n - 1 for n in tokens_per_chunk[1:])
    assert emitted <= kept <= emitted + 4
