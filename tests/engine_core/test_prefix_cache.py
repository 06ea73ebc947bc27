"""Prefix caching on the real model: identical greedy outputs with it on and off, real hits, and cached
K/V equal to a fresh recompute."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.sampling_params import SamplingParams
from tests.helpers import run_engine

SYSTEM = (
    "You are a careful assistant. Answer briefly and truthfully. If you do not know, say so. "
    "Use plain words, avoid jargon, and keep every answer under fifty words. "
) * 2
QUESTIONS = [
    "What is the capital of Spain?",
    "Name a prime number.",
    "Why is the sky blue?",
    "What do bees make?",
    "How many legs has a spider?",
]


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]


@pytest.mark.parametrize("mode", ["plain", "chunked", "preempting"])
def test_greedy_outputs_identical_with_caching_on_and_off(default_model_dir, tokenizer, mode):
    engine_args = {
        "plain": {},
        "chunked": {"max_num_batched_tokens": 48},
        "preempting": {"num_kv_blocks": 14, "max_num_batched_tokens": 512},
    }[mode]
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for caching in (False, True):
        engine = EngineCore(
            EngineConfig(
                model=str(default_model_dir), kv_cache_memory=64 * 1024**2, enable_prefix_caching=caching, **engine_args
            )
        )
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
    cfg = dict(model=str(default_model_dir), kv_cache_memory=64 * 1024**2)
    cached_engine = EngineCore(EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=40, **cfg))
    prompts = _prompts(tokenizer)
    run_engine(cached_engine, prompts, SamplingParams(max_tokens=8, temperature=0))  # chunked, shared, cached
    fresh = EngineCore(EngineConfig(enable_prefix_caching=False, **cfg))
    fresh.add_request("probe", prompts[3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    fresh.step()  # the whole prompt in one step; the request is still running, its blocks readable
    probe = fresh.scheduler.requests["probe"]
    hashes = cached_engine.kv_manager.block_hashes(probe)[: len(prompts[3]) // 16]  # computed prompt blocks
    compared = 0
    for index, block_hash in enumerate(hashes):
        block = cached_engine.kv_manager.pool.lookup(block_hash)
        if block is None:
            continue
        mine = cached_engine.runner.kv_cache[:, :, block.block_id]
        reference = fresh.runner.kv_cache[:, :, probe.block_ids[0][index]]
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= len(tokenizer.encode(SYSTEM)) // 16


@pytest.fixture(scope="module")
def small_cached_engine(default_model_dir):
    """A real engine with a pool small enough that cached blocks get evicted."""
    return EngineCore(
        EngineConfig(
            model=str(default_model_dir), num_kv_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=True
        )
    )


@pytest.fixture(scope="module")
def fresh_engine(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), num_kv_blocks=64, enable_prefix_caching=False))


_STEMS = [list(range(1000, 1040)), list(range(2000, 2024)), list(range(1000, 1020)) + list(range(3000, 3030))]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 2), st.integers(0, 40), st.integers(1, 6)),
        min_size=4,
        max_size=25,
    )
)
def test_random_traffic_keeps_refcounts_and_cached_kv_exact(small_cached_engine, fresh_engine, events):
    """Random arrivals of prompts sharing stems, steps, aborts and evictions on the real model: ref
    counts never go negative and match their holders, every block is free at the end, and sampled
    cached blocks hold exactly the K/V a fresh engine computes for the same prefix."""
    engine = small_cached_engine
    pool = engine.kv_manager.pool
    next_id = 0
    for kind, stem, extra, max_tokens in events:
        if kind == "add":
            prompt = _STEMS[stem] + [4000 + extra + i for i in range(extra % 7)]
            engine.add_request(f"h{next_id}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            next_id += 1
        elif kind == "abort" and engine.scheduler.requests:
            engine.abort_request(sorted(engine.scheduler.requests)[extra % len(engine.scheduler.requests)])
        elif engine.has_unfinished_requests():
            engine.step()
        holders = Counter(b for r in engine.scheduler.running for table in r.block_ids for b in table)
        assert all(block.ref_cnt == holders.get(block.block_id, 0) >= 0 for block in pool.blocks[1:])
    # Last, the first stem alone, to its end: whatever the traffic left cached of it is reused, and its full
    # blocks stay cached, so the comparison below always has those (not only what the events happened to leave).
    engine.add_request(f"h{next_id}", _STEMS[0], SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert pool.num_free_blocks == pool.num_usable_blocks
    compared = 0
    for stem in _STEMS:  # compare what is still cached of each stem with a fresh computation
        fresh_engine.add_request("probe", stem, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        fresh_engine.step()
        probe = fresh_engine.scheduler.requests["probe"]
        for index, block_hash in enumerate(engine.kv_manager.block_hashes(probe)[: len(stem) // 16]):
            block = pool.lookup(block_hash)
            if block is not None:
                torch.testing.assert_close(
                    engine.runner.kv_cache[:, :, block.block_id],
                    fresh_engine.runner.kv_cache[:, :, probe.block_ids[0][index]],
                    rtol=1e-4,
                    atol=1e-4,
                )
                compared += 1
        fresh_engine.abort_request("probe")
    assert compared >= len(_STEMS[0]) // 16  # at least the first stem's full blocks
