"""Tiny random-weight models of each supported architecture, built here from transformers configs and
saved as safetensors: our greedy tokens equal HF `generate` for 32 tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.sampling_params import SamplingParams
from tests.helpers import hf_greedy, run_engine

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.25,
    tie_word_embeddings=False,
)

CASES = {
    "llama3": (
        transformers.LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=8)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=24)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),
}


def _build(tmp_path, name):
    config_cls, extra = CASES[name]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if name == "qwen2":  # make sure the QKV biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    return model, tmp_path / name


@pytest.mark.parametrize("name", list(CASES))
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
    """bf16 takes the torch reference path on the CPU (the C kernel is float32-only)."""
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
    config_cls, extra = CASES["llama3"]
    model_dir = tmp_path / "config-only"
    config_cls(**{**COMMON, **extra}, architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
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
