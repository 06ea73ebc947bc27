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
    assert engine.kv_manager.sliding_window == WINDOW
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
            most_held, table = max(most_held, held), len(request.block_ids)
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


def test_a_model_with_full_attention_layers_keeps_every_block(tmp_path):
    """gpt-oss alternates sliding and full layers: its requests keep all their blocks."""
    model = tiny_models.build("gpt_oss")
    model.save_pretrained(tmp_path / "gpt_oss")
    engine = EngineCore(EngineConfig(model=str(tmp_path / "gpt_oss"), block_size=BLOCK, num_kv_blocks=32))
    assert engine.kv_manager.sliding_window is None
