"""Greedy tokens of the real SmolLM2-135M-Instruct equal HF transformers `generate`, in four modes:
one request at a time, all in one batch, chunked prefill, and a KV pool so small that requests are
preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.llm import LLM
from pagoda.engine_core.sampling_params import SamplingParams
from tests.helpers import golden_prompts, hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(tokenizer):
    result = golden_prompts(tokenizer)
    lengths = sorted(len(p) for p in result)
    assert lengths[0] == 1 and 1200 <= lengths[-1] <= 1600, lengths
    return result


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_hf_reference_stops_at_eos_only_when_asked_and_leaves_the_model_as_it_was(hf_model, tokenizer):
    prompt = tokenizer.encode("The capital of France is")  # greedy, it ends by EOS well before 64 tokens
    config = hf_model.generation_config.to_dict()
    stopped = hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert len(stopped) < NEW_TOKENS and stopped[-1] == hf_model.generation_config.eos_token_id
    full = hf_greedy(hf_model, prompt, NEW_TOKENS, stop_at_eos=False)
    assert len(full) == NEW_TOKENS and full[: len(stopped)] == stopped
    assert hf_model.generation_config.to_dict() == config  # the session's model is shared by later tests
    assert hf_greedy(hf_model, prompt, NEW_TOKENS) == stopped


def _generate(llm: LLM, prompts, one_at_a_time: bool = False) -> list[list[int]]:
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    results = []
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        results.extend(o.outputs[0].token_ids for o in outs)
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    return results


def _assert_same(ours, reference):
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        first_difference = next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-2], strict=False)) if x != y)
        assert a == b, f"prompt {i}: first difference at token {first_difference}"


def test_one_at_a_time(default_model_dir, prompts, hf_reference):
    llm = LLM(str(default_model_dir))
    _assert_same(_generate(llm, prompts, one_at_a_time=True), hf_reference)


def test_all_in_one_batch(default_model_dir, prompts, hf_reference):
    llm = LLM(str(default_model_dir))
    _assert_same(_generate(llm, prompts), hf_reference)


def test_chunked_prefill(default_model_dir, prompts, hf_reference):
    # 96-token steps: long prompts take many steps, each mixed with the other requests' decodes.
    llm = LLM(str(default_model_dir), max_num_batched_tokens=96)
    _assert_same(_generate(llm, prompts), hf_reference)


def test_preemption(default_model_dir, prompts, hf_reference):
    # 110 blocks of 16 = 1,760 tokens: the longest request alone needs ~100, so the batch cannot fit.
    llm = LLM(str(default_model_dir), num_kv_blocks=111, max_num_batched_tokens=512)
    ours = _generate(llm, prompts)
    assert llm.engine.num_preemptions > 0
    _assert_same(ours, hf_reference)


def test_float16_kv_cache(default_model_dir, prompts, hf_reference):
    """`--kv-cache-dtype float16`: K/V rounded to float16 in the cache, read back by the decode kernel, the
    fused decode step and (256-token chunks: later chunks read the earlier ones' K/V) the prefill path.
    On these prompts the rounding changes no greedy token."""
    llm = LLM(str(default_model_dir), kv_cache_dtype="float16", max_num_batched_tokens=256)
    assert llm.engine.runner.kv_cache.dtype == torch.float16
    _assert_same(_generate(llm, prompts), hf_reference)
