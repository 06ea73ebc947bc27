"""Tiny random-weight models of each supported architecture (tests/tiny_models.py), saved as safetensors: our
greedy tokens equal HF `generate` for 32 tokens."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine


def _build(tmp_path, name):
    model = tiny_models.build(name)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


@pytest.mark.parametrize("name", list(tiny_models.ARCHITECTURES))
def test_greedy_matches_hf(tmp_path, name):
    hf_model, model_dir = _build(tmp_path, name)
    gen = torch.Generator().manual_seed(1)
    # Lengths around block boundaries, past the sliding window, and one long enough to need chunks.
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 70)]
    expected = [hf_greedy(hf_model, p, 32, stop_at_eos=False) for p in prompts]
    engine = EngineCore(EngineConfig(model=str(model_dir), max_num_batched_tokens=48, num_kv_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert run_engine(engine, prompts, params) == expected


def test_incomplete_checkpoint_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, model_dir = _build(tmp_path, "llama3")
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]  # one shard of a merged QKV projection
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights.*layers.1.self_attn.qkv_proj"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


def test_unsupported_architecture_is_named(tmp_path):
    _, model_dir = _build(tmp_path, "llama3")
    config = (model_dir / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (model_dir / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


def test_bfloat16_runs_and_mostly_agrees_with_float32(tmp_path):
    """bf16 on the CPU: linears in oneDNN's packed bfloat16 matmul where the CPU has bfloat16 instructions
    (engine_core/layers/linear.py), the rest on the torch reference path (the C kernels are float32-only)."""
    _, model_dir = _build(tmp_path, "llama3")
    prompts = [[5, 17, 300, 41] * k for k in (1, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bf16 = run_engine(
        EngineCore(EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=32)), prompts, params
    )
    fp32 = run_engine(EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=32)), prompts, params)
    assert all(len(t) == 8 for t in bf16)
    assert [t[0] for t in bf16] == [t[0] for t in fp32]  # first tokens survive bf16 rounding


def test_dummy_weights_need_only_a_config_and_are_reproducible(tmp_path):
    """`load_format="dummy"`: a model directory holding just config.json runs, with the same random
    weights every time (the GPU benchmark builds Llama-3-8B this way)."""
    config_cls, extra = tiny_models.ARCHITECTURES["llama3"]
    model_dir = tmp_path / "config-only"
    config_cls(**{**tiny_models.COMMON, **extra}, architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    assert [p.name for p in model_dir.iterdir()] == ["config.json"]
    prompts = [[5, 6, 7, 8], list(range(10, 40))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = EngineCore(EngineConfig(model=str(model_dir), load_format="dummy", num_kv_blocks=32))
        norms = {n: p for n, p in engine.runner.model.named_parameters() if n.endswith("norm.weight")}
        assert norms and all(bool((p == 1).all()) for p in norms.values())
        runs.append(run_engine(engine, prompts, params))
    assert runs[0] == runs[1] and all(len(r) == 8 for r in runs[0])
    assert len(set(map(tuple, runs[0]))) == 2  # different prompts, different continuations: weights are not all equal


def test_the_last_layer_computes_only_the_rows_a_step_reads(tmp_path):
    """Past the last layer's attention, a step with prompt rows computes only the rows its LM head reads
    (llama.cpp's trick): the last layer's MLP sees one row per prompt that samples (none for a chunk that
    stops short of its prompt's end), the layer before it every row; tokens still equal HF's."""
    hf_model, model_dir = _build(tmp_path, "llama3")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 20, 70)]
    expected = [hf_greedy(hf_model, p, 4, stop_at_eos=False) for p in prompts]
    engine = EngineCore(EngineConfig(model=str(model_dir), max_num_batched_tokens=64, num_kv_blocks=64))
    layers = engine.runner.model.decoder_layers()
    rows: dict[str, list[int]] = {"last": [], "before": []}
    for name, layer in (("last", layers[-1]), ("before", layers[-2])):
        layer.mlp.register_forward_hook(lambda _m, args, _out, name=name: rows[name].append(args[0].shape[0]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert run_engine(engine, prompts, params) == expected
    # Step 1: the 9- and 20-token prompts whole (2 rows read) and 35 of the 70 (none read); step 2: the
    # two decodes and the last 35 prompt rows (3 read); then decode steps, which read every row (and run
    # as one fused C call where the CPU kernels are built: no module hooks fire).
    assert rows["before"][:2] == [64, 37] and rows["last"][:2] == [2, 3]
    assert rows["last"][2:] == rows["before"][2:]
