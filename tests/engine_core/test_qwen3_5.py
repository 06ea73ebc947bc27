"""Qwen3.5 in the engine: its Gated DeltaNet layers keep a recurrent state per running request in the state
pool (engine_core/state_pool.py), its full-attention layers paged KV. Greedy tokens equal HF generate's
under chunked prefill, a batch joining and leaving, preemption (recompute from a fresh state) and aborts;
the pool holds exactly one slot per running request; prefix caching is off without state snapshots
(test_recurrent_prefix_cache.py tests it with them) and speculative decoding refused for these models.
(test_tiny_models.py checks the dense and MoE models on the golden lengths.)"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine


@pytest.fixture(scope="module", params=tiny_models.QWEN3_5)
def saved(request, tmp_path_factory):
    model = tiny_models.build(request.param)
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path)
    return model, path


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def test_a_tight_pool_preempts_and_recomputes_from_fresh_states(saved):
    """Six requests, at most four running, in a KV pool too small for them all: preempted requests give
    their slot back and recompute from position 0 (a fresh, zeroed slot); every token stays HF's."""
    hf_model, path = saved
    prompts = _prompts([3, 40, 17, 64, 9, 25])
    expected = [hf_greedy(hf_model, p, 20, stop_at_eos=False) for p in prompts]
    engine = EngineCore(
        EngineConfig(model=str(path), block_size=8, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=24)
    )
    assert engine.kv_manager.states is not None and engine.kv_manager.states.num_slots == 4
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert run_engine(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions_total > 0


def test_the_state_pool_holds_one_slot_per_running_request(saved):
    _, path = saved
    engine = EngineCore(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64, max_num_seqs=3))
    states = engine.kv_manager.states
    assert states is not None
    prompts = _prompts([12, 5, 30, 8])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    engine.abort_request("r1")  # (its slot goes back with its blocks)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        assert states.num_slots - states.num_free == len(running)
        assert len({r.state_slot for r in running}) == len(running) and 0 not in {r.state_slot for r in running}
        seen |= {r.request_id for r in running}
        engine.check_integrity()
    assert "r3" in seen  # (it ran once a slot was free)
    assert states.num_free == states.num_slots


def test_prefix_caching_is_off_without_snapshots_and_speculation_refused(saved):
    hf_model, path = saved
    config = EngineConfig(model=str(path), num_kv_blocks=32, enable_prefix_caching=True, recurrent_state_snapshots=0)
    engine = EngineCore(config)
    assert not engine.kv_manager.enable_caching and engine.kv_manager.snapshots is None
    prompt = _prompts([40])[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert run_engine(engine, [prompt, prompt], params) == [hf_greedy(hf_model, prompt, 8, stop_at_eos=False)] * 2
    with pytest.raises(ValueError, match=r"recurrent layers.*speculative decoding is not supported"):
        EngineCore(
            EngineConfig(
                model=str(path),
                num_kv_blocks=32,
                speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
            )
        )
