"""A model whose every layer slides over the same window (a tiny Mistral, window 24) holds only the KV
blocks its window needs: the blocks a request's window has left go back to the pool as it grows, and its
greedy tokens still equal HF's, past 8x the window, with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine

WINDOW = 24
BLOCK = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model = tiny_models.build("mistral", sliding_window=WINDOW)
    path = tmp_path_factory.mktemp("mistral") / "model"
    model.save_pretrained(path)
    return model, path


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def test_a_conversation_8x_the_window_holds_the_window_and_one_block(mistral):
    hf_model, path = mistral
    engine = EngineCore(EngineConfig(model=str(path), block_size=BLOCK, max_num_batched_tokens=32, num_kv_blocks=64))
    assert engine.kv_manager.windows == (WINDOW,)
    prompt = _prompts([8 * WINDOW])[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("talk", prompt, params)
    request = engine.scheduler.requests["talk"]
    tokens, most_held, table = [], 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if not request.status.finished:
            held = engine.kv_manager.num_blocks_held(request)
            most_held, table = max(most_held, held), len(request.block_ids[0])
            if request.num_computed_tokens > request.num_prompt_tokens:  # decoding: one token a step
                assert held <= WINDOW // BLOCK + 1, (request.num_computed_tokens, held)
        engine.check_integrity()
    assert tokens == hf_greedy(hf_model, prompt, 40, stop_at_eos=False)
    # (prefill chunks of 32 tokens: the window before a chunk and the chunk itself)
    assert most_held <= -(-(WINDOW - 1 + 32) // BLOCK) + 1
    assert table == -(-(8 * WINDOW + 39) // BLOCK)  # (the block table still spans the sequence: null blocks)
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    # A request of any length fits in a pool of 63 blocks (504 tokens), so the context is the model's.
    assert engine.max_model_len == hf_model.config.max_position_embeddings


def test_greedy_equals_hf_under_prefix_caching_and_preemption(mistral):
    """A shared prefix longer than the window is computed once and reused while its blocks are cached;
    a pool too small for every request at once preempts and recomputes; tokens stay HF's."""
    hf_model, path = mistral
    shared = _prompts([70])[0]
    prompts = [shared + tail for tail in _prompts([5, 17, 30, 1])]
    expected = [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cached = EngineCore(EngineConfig(model=str(path), block_size=BLOCK, max_num_batched_tokens=48, num_kv_blocks=96))
    assert run_engine(cached, prompts[:1], params) == expected[:1]  # (its blocks stay cached once freed)
    assert run_engine(cached, prompts[1:], params) == expected[1:]
    assert cached.kv_manager.prefix_cache_hits > 0
    tight = EngineCore(
        EngineConfig(
            model=str(path), block_size=BLOCK, max_num_batched_tokens=48, num_kv_blocks=14, enable_prefix_caching=False
        )
    )
    assert run_engine(tight, prompts, params) == expected


def test_sliding_and_full_layers_each_hold_what_they_read(tmp_path):
    """gpt-oss alternates 8-token sliding and full layers: two KV groups, each block id holding two layers'
    K/V (half of what one group of all four would take). The full group keeps every block of a request,
    the sliding one its window's; tokens stay HF's."""
    hf_model = tiny_models.build("gpt_oss")
    hf_model.save_pretrained(tmp_path / "gpt_oss")
    window = hf_model.config.sliding_window
    engine = EngineCore(
        EngineConfig(model=str(tmp_path / "gpt_oss"), block_size=BLOCK, max_num_batched_tokens=16, num_kv_blocks=64)
    )
    assert engine.kv_manager.windows == (window, None)
    assert engine.runner.kv_cache is not None and engine.runner.kv_cache.shape[0] == 2  # (slots per block)
    prompt = _prompts([6 * BLOCK + 3])[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    request = engine.scheduler.requests["r"]
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if not request.status.finished and request.num_computed_tokens > request.num_prompt_tokens:
            sliding, full = request.block_ids
            assert 0 not in full and len(full) == -(-request.num_computed_tokens // BLOCK)
            assert sum(1 for b in sliding if b != 0) <= -(-window // BLOCK) + 1
        engine.check_integrity()
    assert tokens == hf_greedy(hf_model, prompt, 20, stop_at_eos=False)


def test_a_shared_1024_token_prefix_is_computed_once_on_a_hybrid(tmp_path):
    """Gemma 3 (8-token sliding layers and full ones): a second request sharing a 1,024-token prefix resumes
    after it (its full group's blocks and its sliding groups' last window all cached) and computes only its
    own tail; its tokens equal those of an engine without the cache, and HF's."""
    hf_model = tiny_models.build("gemma3", max_position_embeddings=2048)
    hf_model.save_pretrained(tmp_path / "gemma3")
    shared = _prompts([1024])[0]
    prompts = [shared + tail for tail in _prompts([9, 3])]  # (the second's tail sees the prefix's last keys)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    config = dict(model=str(tmp_path / "gemma3"), num_kv_blocks=400, max_num_batched_tokens=256)
    cached = EngineCore(EngineConfig(**config))
    assert len(cached.kv_manager.windows) > 1 and None in cached.kv_manager.windows
    first = run_engine(cached, prompts[:1], params)
    cached.add_request("second", prompts[1], params)
    second_request = cached.scheduler.requests["second"]
    second = []
    while cached.has_unfinished_requests():
        for out in cached.step():
            second += out.new_token_ids
    assert second_request.num_cached_tokens == 1024  # (64 blocks of 16: the prefix computed once)
    plain = EngineCore(EngineConfig(**config, enable_prefix_caching=False))
    assert run_engine(plain, prompts, params) == [*first, second]
    assert second == hf_greedy(hf_model, prompts[1], 10, stop_at_eos=False)


def test_a_pool_smaller_than_one_block_per_group_is_refused(tmp_path):
    tiny_models.build("gemma3").save_pretrained(tmp_path / "gemma3")
    with pytest.raises(ValueError, match=r"cannot hold one block of each of the model's 4 KV groups"):
        EngineCore(EngineConfig(model=str(tmp_path / "gemma3"), num_kv_blocks=3))
