"""Prefix caching on the real model: identical greedy outputs with it on and off, real hits, and cached
K/V equal to a fresh recompute."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.helpers import run_engine

SYSTEM = ("You are a careful assistant. Answer briefly and truthfully. If you do not know, say so. "
          "Use plain words, avoid jargon, and keep every answer under fifty words. ") * 2
QUESTIONS = ["What is the capital of Spain?", "Name a prime number.", "Why is the sky blue?",
             "What do bees make?", "How many legs has a spider?"]


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]


@pytest.mark.parametrize("mode", ["plain", "chunked", "preempting"])
def test_greedy_outputs_identical_with_caching_on_and_off(default_model_dir, tokenizer, mode):
    engine_args = {"plain": {}, "chunked": {"max_num_batched_tokens": 48},
                   "preempting": {"num_kv_blocks": 14, "max_num_batched_tokens": 512}}[mode]
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for caching in (False, True):
        engine = EngineCore(EngineConfig(model=str(default_model_dir), kv_cache_memory=64 * 1024 ** 2,
                                         enable_prefix_caching=caching, **engine_args))
        first = run_engine(engine, prompts[:1], params)  # warms the cache with the shared prefix
        rest = run_engine(engine, prompts[1:], params)
        outputs[caching] = first + rest
        stats = engine.scheduler.stats()
        if caching:
            assert stats.prefix_cache_hits >= 4 * (len(tokenizer.encode(SYSTEM)) // 16) * 16
        else:
            assert stats.prefix_cache_hits == 0
        if mode == "preempting":
            assert stats.num_preemptions > 0
    assert outputs[True] == outputs[False]


def test_n_samples_share_the_prompt_blocks(default_model_dir, tokenizer):
    llm = LLM(str(default_model_dir), kv_cache_memory="64MiB")
    prompt = {"prompt_token_ids": _prompts(tokenizer)[0]}
    single = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    llm.reset_prefix_cache()
    before = llm.engine.scheduler.stats().prefix_cache_hits
    group = llm.generate(prompt, SamplingParams(n=3, max_tokens=16, temperature=0), use_tqdm=False)[0]
    hits = llm.engine.scheduler.stats().prefix_cache_hits - before
    full = (len(prompt["prompt_token_ids"]) - 1) // 16 * 16
    assert hits == 2 * full  # samples 1 and 2 computed only the prompt's last partial block
    assert [o.token_ids for o in group.outputs] == [single.outputs[0].token_ids] * 3
    assert group.num_cached_tokens == 0  # sample 0 computed the prompt
    again = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == full
    assert llm.reset_prefix_cache() > 0
    assert llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)[0].num_cached_tokens == 0


def test_cached_blocks_hold_the_kv_of_a_fresh_recompute(default_model_dir, tokenizer):
    cfg = dict(model=str(default_model_dir), kv_cache_memory=64 * 1024 ** 2)
    cached_engine = EngineCore(EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=40, **cfg))
    prompts = _prompts(tokenizer)
    run_engine(cached_engine, prompts, SamplingParams(max_tokens=8, temperature=0))  # chunked, shared, cached
    fresh = EngineCore(EngineConfig(enable_prefix_caching=False, **cfg))
    fresh.add_request("probe", prompts[3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    fresh.step()  # the whole prompt in one step; the request is still running, its blocks readable
    probe = fresh.scheduler.requests["probe"]
    hashes = cached_engine.kv_manager.block_hashes(probe)[:len(prompts[3]) // 16]  # computed prompt blocks
    compared = 0
    for index, block_hash in enumerate(hashes):
        block = cached_engine.kv_manager.pool.lookup(block_hash)
        if block is None:
            continue
        mine = cached_engine.runner.kv_cache[:, :, block.block_id]
        reference = fresh.runner.kv_cache[:, :, probe.block_ids[index]]
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= len(tokenizer.encode(SYSTEM)) // 16
