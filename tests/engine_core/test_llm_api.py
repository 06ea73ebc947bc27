"""The offline API as a vLLM user would call it, on the real default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagoda.engine_core import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir))


GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_chat_answers_the_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text == "The capital of France is Paris." and completion.finish_reason == "stop"
    assert completion.token_ids[-1] == 2  # <|im_end|>, the EOS from generation_config.json


def test_prompt_forms_and_order(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([text, {"prompt_token_ids": ids}, "Water boils at"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [text, None, "Water boils at"]
    assert outs[0].prompt_token_ids == ids and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    single = llm.generate("Water boils at", GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_per_prompt_params_and_length_finish(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    outs = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], params[:1], use_tqdm=False)


def test_n_samples_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=2, ignore_eos=True)
    out = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == 8
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and all(lp.logprob <= 0 for lp in entry.values())
            ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank is not None)
            assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]


def test_bad_requests_are_rejected_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate({"prompt_token_ids": [5] * 9000}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**6]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="prompt 1"):  # the good first prompt is not left queued
        llm.generate(["fine", {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    still = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(still[0].outputs[0].token_ids) == 4 and still[0].outputs[0].finish_reason == "length"


def test_abort_frees_everything(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"abort-{i}", [5] * 40, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    for i in range(3):
        assert engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks


def test_cli_generate(default_model_dir):
    env = dict(os.environ)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.api_proc.cli",
            "generate",
            "--chat",
            "--model",
            str(default_model_dir),
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."


def test_cli_reports_bad_model_cleanly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", "generate", "--model", str(tmp_path), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "config.json" in result.stderr
