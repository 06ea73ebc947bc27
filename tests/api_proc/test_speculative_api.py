"""`pagoda serve --speculative-config` through HTTP and the `openai` SDK: the same greedy text as a server
without speculation, streamed and whole, with n-gram proposals and with a draft model; a bad draft model
stops the server at start-up; a streamed chunk carries several tokens when proposals hold
(their logprobs one per token); the vllm:spec_decode_* counters in /metrics agree with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME
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
def servers(start_server, tmp_path_factory):
    """A plain server, one speculating with n-grams and one with a draft model (SmolLM2's first 10 layers)."""
    from benchmarks.spec_decode import truncated_model
    from pagoda.engine_core.default_model import ensure_default_model

    draft = truncated_model(ensure_default_model(), tmp_path_factory.mktemp("draft") / "smol10", 10)
    drafting = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(start_server)
        speculating = pool.submit(start_server, "--speculative-config", NGRAM, "--speculative-disable-batch-size", "8")
        with_draft = pool.submit(start_server, "--speculative-config", drafting)
        return plain.result(), speculating.result(), with_draft.result()


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


@pytest.mark.slow
def test_greedy_text_equals_the_plain_servers_streamed_and_whole(servers):
    plain, *speculating_servers = servers
    for prompt in PROMPTS:
        expected = chat(plain, prompt, stream=False).choices[0].message.content
        for speculating in speculating_servers:
            assert chat(speculating, prompt, stream=False).choices[0].message.content == expected
            chunks = [c for c in chat(speculating, prompt, stream=True) if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_a_chunk_carries_several_tokens_and_the_counters_agree(servers):
    _, speculating, _ = servers
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


def test_a_draft_model_with_another_vocabulary_stops_the_server_at_start(tmp_path):
    """`pagoda serve` names the problem and leaves nothing behind: a draft path that does not exist is
    refused before anything starts; a draft whose vocabulary differs, when the engine loads it."""
    from tests.parallel_checks import tiny_model

    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir()

    def serve(draft) -> subprocess.CompletedProcess:
        spec = json.dumps({"method": "draft_model", "model": str(draft)})
        command = [sys.executable, "-m", "pagoda.api_proc.cli", "serve", "--port", "0", "--speculative-config", spec]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)

    run = serve(tmp_path / "missing")
    assert run.returncode == 2 and "does not exist" in run.stderr, run.stderr
    other = tiny_model(tmp_path, "other", "llama", dict(vocab_size=512))
    run = serve(other)
    assert run.returncode != 0, run.stderr
    assert "does not share the target's vocabulary: vocab size 512 (target: 49152)" in run.stderr, run.stderr
    assert list((tmp_path / "run").iterdir()) == []  # no runtime directory left
