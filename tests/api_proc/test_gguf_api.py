"""`pagoda serve model.gguf`: a real server on the default model's Q4_1 GGUF file, through the official
`openai` SDK; its name, its tokenizer (from the file's metadata) and `pagoda download-default --gguf`."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pagoda.api_proc.bench.local_server import http
from pagoda.engine_core.default_model import default_gguf_path, ensure_default_gguf
from pagoda.engine_core.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello world", " The capital of France is", "déjà vu 🤖 naïve", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def gguf_file():
    return ensure_default_gguf()


@pytest.fixture(scope="module")
def gguf_server(start_server, gguf_file):
    return start_server(str(gguf_file))  # the MODEL argument, as a user types it


@pytest.fixture(scope="module")
def gguf_client(gguf_server):
    return openai.OpenAI(base_url=gguf_server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_chat_completion_equals_the_offline_engine_on_the_same_file(gguf_client, gguf_file):
    from pagoda.engine_core.llm import LLM

    offline = LLM(str(gguf_file), kv_cache_memory="256MiB")
    expected = offline.chat(CHAT, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    response = gguf_client.chat.completions.create(model=str(gguf_file), messages=CHAT, max_tokens=24, temperature=0)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert "Paris" in response.choices[0].message.content
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.model == str(gguf_file)


def test_the_model_is_listed_under_the_files_name(gguf_client, gguf_server, gguf_file):
    models = gguf_client.models.list().data
    assert [m.id for m in models] == [str(gguf_file)]  # vLLM's default: the model as given
    status, body = http("GET", gguf_server.base_url + "/v1/models")
    assert status == 200 and body["data"][0]["root"] == str(gguf_file)  # the file, not the directory made from it


def test_the_tokenizer_process_uses_the_files_tokenizer(gguf_server, gguf_file, tokenizer):
    for text in TEXTS:
        status, body = http("POST", gguf_server.base_url + "/tokenize", {"model": str(gguf_file), "prompt": text})
        assert status == 200, body
        assert body["tokens"] == tokenizer.encode(text), text  # the float32 directory's tokenizer


def test_download_default_prints_the_gguf_file():
    out = subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", "download-default", "--gguf"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(default_gguf_path()) and default_gguf_path().exists()
