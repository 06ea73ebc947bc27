"""Pipeline parallel on the CPU: real stage processes joined over gloo, compared with the single-rank engine.

Greedy tokens and first-step logprobs of PP=2 against PP=1 on SmolLM2's golden prompts (30 layers: 15
per stage), TP=2 x PP=2 (four processes) and PP=3 (3 layers: one each) on tiny models; the scheduler's
paths under pipelining (steps in flight with disjoint requests, preemption only of requests not in
flight, prefix caching, prompt logprobs, aborts of requests in flight); a dead stage fails the engine at
once; splits that cannot work are refused before any worker starts.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.parallel.stage import Stage
from pagoda.engine_core.sampling_params import SamplingParams
from tests.helpers import golden_prompts, greedy_with_first_logprobs
from tests.parallel_checks import (
    TOLERANCE,
    compare_runs,
    killed_worker_fails_the_next_step,
    random_prompts,
    shared_prefix_case,
    tiny_model,
    worker_processes,
)


def _runs(model_dir, prompts, splits: list[dict], **engine_args):
    return [greedy_with_first_logprobs(model_dir, prompts, 32, **split, **engine_args) for split in splits]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("pp"), "llama", "llama3", {})


def test_stages_split_the_layers_contiguously_the_first_one_lighter_by_its_lm_head():
    assert [Stage(i, 2).layers(30) for i in range(2)] == [range(0, 15), range(15, 30)]
    assert [Stage(i, 4).layers(30) for i in range(4)] == [range(0, 8), range(8, 15), range(15, 22), range(22, 30)]
    # SmolLM2: its LM head (49,152 x 576) weighs as much as 8 of its layers.
    assert [Stage(i, 2).layers(30, head_cost=8.0) for i in range(2)] == [range(0, 11), range(11, 30)]
    assert [Stage(i, 4).layers(30, head_cost=8.0) for i in range(4)] == [
        range(0, 2),
        range(2, 11),
        range(11, 20),
        range(20, 30),
    ]
    assert [Stage(i, 3).layers(3, head_cost=5.0) for i in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert Stage(0, 1).layers(3, head_cost=2.0) == range(3) and Stage(0, 1).is_first and Stage(0, 1).is_last


@pytest.mark.slow
def test_smollm2_golden_prompts(default_model_dir, tokenizer):
    prompts = golden_prompts(tokenizer)
    splits = [{}, {"pipeline_parallel_size": 2}]
    compare_runs(_runs(default_model_dir, prompts, splits, num_kv_blocks=512), min_identical=9)


def test_tensor_parallel_2_x_pipeline_parallel_2(tiny_llama):
    splits = [{}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "cpu_threads_bind": "none"}]
    compare_runs(_runs(tiny_llama, random_prompts(), splits, max_num_batched_tokens=48, num_kv_blocks=64), 4)


def test_three_stages_of_one_layer_each_on_a_tied_model(tmp_path):
    """Qwen2 ties its LM head to the embedding (both on the first stage) and has QKV biases."""
    model_dir = tiny_model(tmp_path, "qwen2", "qwen2", {})
    splits = [{}, {"pipeline_parallel_size": 3, "cpu_threads_bind": "none"}]
    compare_runs(_runs(model_dir, random_prompts(), splits, max_num_batched_tokens=48, num_kv_blocks=64), 5)


def test_steps_in_flight_hold_disjoint_requests_and_aborts_in_flight_leak_nothing(tiny_llama):
    """Two stages: a step starts the next batch before it finishes the oldest, the two batches share no
    request, every request still gets exactly its tokens, and a request aborted while its step is in
    flight gets no token and leaves no block behind."""
    engine = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, pipeline_parallel_size=2))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"r{i}", list(range(3 + i, 20 + i)), params)
        counts = {f"r{i}": 0 for i in range(6)}
        for out in engine.step():
            counts[out.request_id] += len(out.new_token_ids)
        assert len(engine.in_flight) == 1  # two started, the oldest finished
        (in_flight, _), *_ = engine.in_flight
        aborted = in_flight.requests[0].request_id
        assert engine.abort_request(aborted)
        overlapped = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] += len(out.new_token_ids)
            steps = [{r.request_id for r in sched.requests} for sched, _ in engine.in_flight]
            assert len(steps) <= 2 and (len(steps) < 2 or not steps[0] & steps[1])
            overlapped += len(steps) == 1
            engine.check_integrity()
        assert overlapped > 5  # steps really were in flight beside the one finishing
        assert counts.pop(aborted) == 0  # its step finished after the abort: its token was dropped
        assert set(counts.values()) == {12}
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
    finally:
        engine.close()


def test_preemption_prefix_caching_and_prompt_logprobs(tiny_llama):
    """A KV pool too small for every request at once (preemption, recompute: never of a request in
    flight), prompts sharing a prefix (cache hits), and prompt logprobs (the last stage sends back their
    rows too): the tokens equal the single-rank engine's exactly, and so do the prompt logprobs' tokens
    and ranks."""
    prompts, params = shared_prefix_case()
    results, stats = [], []
    for pp in (1, 2):
        config = EngineConfig(
            model=str(tiny_llama), num_kv_blocks=14, max_num_batched_tokens=64, pipeline_parallel_size=pp
        )
        engine = EngineCore(config)
        try:
            results.append(_tokens_and_prompt_logprobs(engine, prompts, params))
            stats.append((engine.num_preemptions, engine.kv_manager.prefix_cache_hits))
        finally:
            engine.close()
    for (tokens_1, prompt_1), (tokens_2, prompt_2) in zip(*results, strict=True):
        assert tokens_2 == tokens_1
        if prompt_1 is None:
            assert prompt_2 is None
            continue
        # The same top tokens and ranks; logprobs to float32 roundoff (the batches are composed
        # differently when steps are pipelined, and a matmul's rounding depends on its row count).
        assert (prompt_2.token_ids, prompt_2.ranks) == (prompt_1.token_ids, prompt_1.ranks)
        one, two = (np.frombuffer(p.logprobs, dtype=np.float32) for p in (prompt_1, prompt_2))
        assert np.abs(one - two).max() < TOLERANCE
    assert sum(plp is not None for _, plp in results[1]) == 3
    preemptions, hits = stats[1]
    assert preemptions > 0 and hits > 0, stats


def _tokens_and_prompt_logprobs(engine, prompts, params):
    """Each request's tokens and packed prompt logprobs (bytes: compared exactly), with the block checks
    of run_engine after every step."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"req-{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
    prompt_logprobs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
        engine.check_integrity()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
    return [(tokens[rid], prompt_logprobs.get(rid)) for rid in tokens]


def test_more_stages_than_layers_fail_before_any_worker_starts(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3 layers"):
        EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, pipeline_parallel_size=4))
    assert worker_processes() == []


def test_a_killed_last_stage_fails_the_next_step(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=32, pipeline_parallel_size=2)
    killed_worker_fails_the_next_step(config, r"rank 1 \(pipeline stage 2, tensor-parallel rank 0\) .* signal 9")
