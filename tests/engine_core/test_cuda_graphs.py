"""The CUDA-graph decode path as far as the CPU allows: persistent buffers, padding to captured sizes
and pad rows on the null block give the same greedy tokens as eager steps; GPU memory sizing arithmetic;
the profiling step runs and leaves no trace. (Capture itself needs a GPU: benchmarks/gpu_check.sh.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.cuda_graphs import DecodeGraphs, capture_sizes, model_capturable
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.gpu_memory import GiB, MemoryProfile, profile_step
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.gpt_oss import GptOssMLP
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.quantization.at_load import quantize_int8_per_channel
from pagoda.engine_core.quantization.base import pack_shards
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from tests.helpers import run_engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 5, 8,",
    "Dear Sir or Madam,",
    "The best way to learn a language is",
    "Water boils at",
    "import numpy as np",
]


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _moe_layer(quantized: bool) -> MoEMLP:
    """One Qwen3-MoE layer of a small config, its experts plain or quantized (PackedExperts)."""
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
        o_proj_bias=False, sliding_window=None, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    layer = MoEMLP(cfg, torch.float32, weights_in_hidden_dtype=True)
    if quantized:
        for index in range(layer.shard_count(layer.w13)):
            layer.set_quantized_shard(
                index, layer.w13, pack_shards("w13", [quantize_int8_per_channel(torch.randn(32, 64))])
            )
        for index in range(layer.shard_count(layer.w2)):
            layer.set_quantized_shard(
                index, layer.w2, pack_shards("w2", [quantize_int8_per_channel(torch.randn(64, 32))])
            )
    return layer


@pytest.mark.parametrize(
    "layer,triton,capturable",
    [
        ("dense", True, True),
        ("dense", False, True),
        ("moe", True, True),
        ("moe", False, False),  # (Triton off: the torch reference)
        ("quantized moe", True, False),  # (the Triton kernel takes plain experts only)
        ("gpt-oss", True, False),  # (its experts' keyword options run the reference)
    ],
)
def test_moe_models_are_captured_where_the_fused_op_runs_triton(monkeypatch, layer, triton, capturable):
    """The Triton fused MoE reads nothing on the host; the torch reference (Triton off, quantized experts,
    gpt-oss's experts) reads the routing. Each layer says which it runs (`reads_host`)."""
    pytest.importorskip("triton")
    monkeypatch.setitem(ops._enabled, "cuda", triton)
    ops._resolve.cache_clear()
    modules = {
        "dense": lambda: torch.nn.Linear(4, 4),
        "moe": lambda: _moe_layer(quantized=False),
        "quantized moe": lambda: _moe_layer(quantized=True),
        "gpt-oss": lambda: object.__new__(GptOssMLP),
    }
    try:
        model = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        module = modules[layer]()
        if isinstance(module, GptOssMLP):
            torch.nn.Module.__init__(module)
        model.append(module)
        assert model_capturable(model, torch.device("cuda")) is capturable
    finally:
        ops._resolve.cache_clear()


def _run_staggered(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Two requests arrive every third step, so decode batches grow and shrink, mix with prefills, and
    late arrivals get the blocks of requests that just finished."""
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if step % 3 == 0:
            for index, prompt in pending[:2]:
                engine.add_request(
                    f"r{index}", prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens[index])
                )
            pending = pending[2:]
        step += 1
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        engine.check_integrity()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("max_num_seqs", [8, 5])
def test_padded_decode_buffers_give_the_eager_tokens(default_model_dir, tokenizer, max_num_seqs):
    # A small pool without prefix caching: finished requests' blocks are reused at once, so a pad row
    # still pointing at an old request's slot would overwrite a live request's K/V and change its tokens.
    prompts = [tokenizer.encode(p) for p in PROMPTS + PROMPTS[::-1]]
    max_tokens = [3, 30, 7, 18, 1, 25, 12, 9, 14, 4, 22, 6, 11, 2, 19, 8]
    results = []
    for graphs in (False, True):
        engine = EngineCore(
            EngineConfig(
                model=str(default_model_dir),
                num_kv_blocks=16,
                max_model_len=256,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=False,
            )
        )
        if graphs:
            engine.runner.enable_decode_graphs(engine.max_model_len, capture=False)
            padded_sizes = []
            run = engine.runner.decode_graphs.run
            engine.runner.decode_graphs.run = lambda ids, *a, sizes=padded_sizes, run=run: (
                sizes.append(len(ids)),
                run(ids, *a),
            )[1]
        results.append(_run_staggered(engine, prompts, max_tokens))
    assert [len(r) for r in results[1]] == max_tokens
    assert results[1] == results[0]
    assert {3, 5, 6, 7} & set(padded_sizes), "decode batches that need padding never ran through the buffers"


def test_pad_rows_point_at_the_null_block_after_a_larger_batch(default_model_dir):
    """Rows past the batch must be one-token sequences on block 0, never a previous batch's slots (a
    replayed pad row writes its K/V: into a reused block, that would corrupt another request)."""
    engine = EngineCore(EngineConfig(model=str(default_model_dir), num_kv_blocks=40, max_model_len=128, max_num_seqs=8))
    assert engine.runner.kv_cache is not None
    # The rows below attend over 19 positions nothing wrote: zeros, not whatever the pool's memory held
    # (torch.empty; a full run once left NaN there, and the output check below read it).
    engine.runner.kv_cache.zero_()
    graphs = DecodeGraphs(engine.runner.model, 8, engine.max_model_len, 16, torch.device("cpu"), capture=False)
    seen = []
    real_model = graphs.model
    graphs.model = lambda ids, pos, meta: (
        seen.append((meta.slot_mapping.clone(), meta.seq_lens.clone(), meta.block_tables.clone())),
        real_model(ids, pos, meta),
    )[1]

    def decode(batch: int):
        rows = np.arange(batch)
        blocks = [[1 + 2 * row, 2 + 2 * row] for row in rows]  # 20 tokens each: second block partly used
        slots = np.array([[b[1] * 16 + 3 for b in blocks]])  # (one KV group)
        return graphs.run(rows + 5, np.full(batch, 19), slots, np.full(batch, 20), [[b] for b in blocks])

    assert decode(8).shape[0] == 8
    out = decode(3)
    assert out.shape[0] == 3 and torch.isfinite(out).all()
    slots, seq_lens, tables = (seen[-1][0][0], seen[-1][1], seen[-1][2][0])  # (group 0's slots and tables)
    assert len(slots) == 4  # padded to the captured size 4
    assert slots[3] == 0 and seq_lens[3] == 1 and (tables[3] == 0).all()
    assert slots[:3].tolist() == [2 * 16 + 3, 4 * 16 + 3, 6 * 16 + 3]


def test_kv_cache_budget_subtracts_everything_else():
    profile = MemoryProfile(total=140 * GiB, in_use=17 * GiB, activation_peak=3 * GiB, graph_memory=1 * GiB)
    assert profile.kv_cache_bytes(0.9) == int(140 * GiB * 0.9) - 21 * GiB
    assert profile.kv_cache_bytes(0.1) < 0  # the runner turns this into a clear error


def test_profile_step_runs_the_largest_step_the_scheduler_can_make(default_model_dir):
    engine = EngineCore(
        EngineConfig(model=str(default_model_dir), num_kv_blocks=16, max_num_batched_tokens=300, max_num_seqs=4)
    )
    runner = engine.runner
    profile_step(runner, 300)
    assert runner.num_blocks == -(-300 // 16) + 1
    runner.release_kv_cache()
    assert runner.kv_cache is None and all(a.key_cache is None for a in runner.model.attention_layers())


def test_a_hybrid_models_decode_buffers_carry_every_kv_groups_tables(tmp_path):
    """Gemma 3 (sliding and full KV groups): decode steps through the persistent buffers (eager, as the
    trial capture that sizes a GPU's pool runs them) give the tokens of the plain path; a model with
    recurrent layers (Qwen3.5) is never captured, its decode inputs carrying state slots."""
    from tests import tiny_models

    for name in ("gemma3", "qwen3_5"):
        tiny_models.build(name).save_pretrained(tmp_path / name)
    prompts = [[5, 17, 300, 41] * k for k in (1, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for graphs in (False, True):
        engine = EngineCore(EngineConfig(model=str(tmp_path / "gemma3"), num_kv_blocks=64, max_num_seqs=4))
        assert len(engine.runner.kv_layout.groups) > 1
        if graphs:
            engine.runner.enable_decode_graphs(engine.max_model_len, capture=False)
        results.append(run_engine(engine, prompts, params))
    assert results[1] == results[0]
    recurrent = EngineCore(EngineConfig(model=str(tmp_path / "qwen3_5"), num_kv_blocks=32))
    assert not model_capturable(recurrent.runner.model, torch.device("cuda"))
