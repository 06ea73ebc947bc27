"""Qwen3.5 in the engine: its Gated DeltaNet layers keep a recurrent state per running request in the state
pool (engine_core/state_pool.py), its full-attention layers paged KV. Greedy tokens equal HF generate's
under chunked prefill, a batch joining and leaving, preemption (recompute from a fresh state) and aborts;
the pool holds exactly one slot per running request; prefix caching is off without state snapshots
(test_recurrent_prefix_cache.py tests it with them) and speculative decoding refused for these models;
tensor parallel over two ranks (float, and int8 at load) and pipeline parallel over two stages give one
rank's tokens.
(test_tiny_models.py checks the dense and MoE models on the golden lengths.)"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine
from tests.parallel_checks import compare_runs


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


def _tensor_parallel_runs(path, **args):
    prompts = _prompts([1, 6, 17, 40])
    return [
        greedy_with_first_logprobs(path, prompts, 16, tensor_parallel_size=tp, num_kv_blocks=64, **args)
        for tp in (1, 2)
    ]


def test_tensor_parallel_matches_one_rank(saved):
    """TP=2 over gloo: each rank holds one of the Gated DeltaNet's two key heads and two of its four value
    heads (their rows in in_proj_qkv and conv1d put in rank-major order at load), its own recurrent states,
    half the gated attention's heads and half of each MLP or expert."""
    _, path = saved
    compare_runs(_tensor_parallel_runs(path), min_identical=3)


def test_tensor_parallel_with_int8_at_load_matches_one_rank(tmp_path):
    """The dense model quantized at load under TP=2: in_proj_qkv in rank-major order quantized whole, then
    cut. Int8 activations are off: each rank would round its 48 value columns in other groups of 32 than one
    rank rounds all 96, a difference of rounding, not of the split (and the MoE's down projections are scaled
    per rank's columns: tests/engine_core/test_moe_parallel.py)."""
    tiny_models.build("qwen3_5").save_pretrained(tmp_path)
    compare_runs(_tensor_parallel_runs(tmp_path, quantization="int8", int8_activations=False), min_identical=3)


def test_pipeline_parallel_matches_one_stage(saved):
    """PP=2: each stage holds its layers' recurrent states (a stage of linear-attention layers alone keeps no
    KV pool at all) and makes the step's state copies for them."""
    _, path = saved
    prompts = _prompts([1, 6, 17, 40])
    runs = [
        greedy_with_first_logprobs(path, prompts, 16, num_kv_blocks=64, cpu_threads_bind="none", **split)
        for split in ({}, {"pipeline_parallel_size": 2})
    ]
    compare_runs(runs, min_identical=3)


def test_a_split_that_cuts_linear_attention_heads_is_refused(saved):
    from pagoda.engine_core.model_config import ModelConfig
    from pagoda.engine_core.parallel.sharding import check_model_splits

    _, path = saved
    with pytest.raises(ValueError, match="must divide the linear attention's 2 key heads"):
        check_model_splits(ModelConfig.from_dir(path), 4)


def test_stacked_experts_split_over_two_ranks(tmp_path):
    """Qwen3.5-MoE with its experts stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`, as some
    checkpoints store them): TP=2 reads each stacked tensor whole and cuts every expert's piece to the rank
    (engine_core/models/moe.py `stacked_expert_pieces`); tokens and logprobs as one rank's."""
    from safetensors.torch import load_file, save_file

    tiny_models.build("qwen3_5_moe").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts"
        count = sum(1 for name in tensors if name.startswith(prefix) and name.endswith("down_proj.weight"))
        pieces = {
            p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(count)]
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(pieces["gate_proj"], pieces["up_proj"], strict=True)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack(pieces["down_proj"])
    save_file(tensors, tmp_path / "model.safetensors")
    compare_runs(_tensor_parallel_runs(tmp_path), min_identical=3)
