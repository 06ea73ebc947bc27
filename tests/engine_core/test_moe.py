"""Mixture-of-experts models (engine_core/models/moe.py) beyond greedy-equals-HF (test_tiny_models.py): which
layers are MoE, how checkpoints load (float32 experts packed for the fused MoE's C kernel, or kept plain where
the C kernels are off; int8 / int4 experts quantized at load, equal to HF on the same dequantized weights),
and what this release refuses with an error naming the limit (FP8 checkpoints and FP8 at load; the fused CPU
decode step: test_fused_decode.py). GGUF files: test_gguf_moe.py; GPTQ, AWQ and compressed-tensors
checkpoints: test_moe_quantized_checkpoints.py. Tensor, expert and pipeline parallel: test_moe_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.environment import configure_kernels
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.llama_layers import LlamaMLP
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import cpu
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine
from tests.quantization_helpers import write_dequantized_checkpoint


def _saved(tmp_path, name, **overrides):
    model = tiny_models.build(name, **overrides)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def test_dense_configs_have_no_experts(tmp_path):
    _, model_dir = _saved(tmp_path, "qwen3")
    cfg = ModelConfig.from_dir(model_dir)
    assert not cfg.is_moe and cfg.num_experts == 0 and not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("qwen3_moe", {}),  # mlp_only_layers=[1]
        ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])),
        ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),
        ("mixtral", {}),
    ],
)
def test_the_moe_layers_are_hfs(tmp_path, name, overrides):
    """Each layer's MLP kind (and the config's MoE fields) as HF builds them."""
    hf_model, model_dir = _saved(tmp_path, name, **overrides)
    cfg = ModelConfig.from_dir(model_dir)
    hf_moe = [not hasattr(layer.mlp, "gate_proj") for layer in hf_model.model.layers]
    with torch.device("meta"):
        ours = model_class(cfg.architecture)(cfg, torch.float32)
    assert [isinstance(layer.mlp, MoEMLP) for layer in ours.decoder_layers()] == hf_moe
    assert [isinstance(layer.mlp, LlamaMLP) for layer in ours.decoder_layers()] == [not m for m in hf_moe]
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.moe_intermediate_size == 64
    assert cfg.shared_expert_intermediate_size == (128 if name == "qwen2_moe" else 0)
    assert cfg.norm_topk_prob == (name != "qwen2_moe")


def _stacked(weights) -> torch.Tensor:
    """Stacked expert weights [E, N, K] from what a layer holds (plain, packed into panels, or quantized)."""
    if isinstance(weights, torch.Tensor):
        return weights
    return torch.stack([weights.matrix(e) for e in range(weights.num_experts)])


def test_experts_load_into_the_stacked_weights(tmp_path):
    """Each expert's gate/up rows land in its slice of w13, its down projection in w2: the stacked
    weights equal HF's (which stacks them the same way); float32 on the CPU, they are then packed into
    panels for the fused MoE's C kernel and the plain ones released."""
    hf_model, model_dir = _saved(tmp_path, "mixtral")
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    layer = engine.runner.model.decoder_layers()[2]
    hf_experts = hf_model.model.layers[2].mlp.experts
    w13, w2 = layer.mlp.experts()
    if cpu.available():
        assert isinstance(w13, ExpertPanels) and isinstance(w2, ExpertPanels)
        assert layer.mlp.w13.numel() == 0 and layer.mlp.w2.numel() == 0
    assert torch.equal(_stacked(w13), hf_experts.gate_up_proj)
    assert torch.equal(_stacked(w2), hf_experts.down_proj)


@pytest.fixture
def c_kernels_off(monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    yield
    monkeypatch.delenv("PAGODA_DISABLE_CPU_KERNELS")
    configure_kernels()  # (this process's kernels as the environment says again)


def test_without_c_kernels_the_experts_stay_plain_and_keep_hfs_tokens(tmp_path, c_kernels_off):
    hf_model, model_dir = _saved(tmp_path, "qwen3_moe")
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=32))
    mlp = engine.runner.model.decoder_layers()[0].mlp
    assert mlp.packed13 is None and mlp.w13.numel() > 0
    prompts = [[5, 17, 300, 41], list(range(3, 40))]
    tokens = run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert tokens == [hf_greedy(hf_model, p, 12, stop_at_eos=False) for p in prompts]


def test_a_missing_expert_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, model_dir = _saved(tmp_path, "qwen3_moe")
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights.*layers.2.mlp.w13"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


@pytest.mark.parametrize(("flag", "bits"), [("int8", 8), ("int4", 4)])
def test_experts_quantized_at_load_give_hfs_tokens_on_the_same_weights(tmp_path, flag, bits):
    """`--quantization int8|int4`: every expert's projections quantized (the router in full precision), the
    stacked parameters never allocated in full precision, and the greedy tokens of HF's model holding exactly
    the dequantized weights (tests/quantization_helpers.py)."""
    import transformers

    original, model_dir = _saved(tmp_path, "qwen3_moe")
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=32, quantization=flag))
    model = engine.runner.model
    mlp = model.decoder_layers()[0].mlp
    assert isinstance(mlp, MoEMLP) and mlp.w13.is_meta and mlp.w2.is_meta
    w13, w2 = mlp.experts()
    assert isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)
    assert (w13.bits, w2.bits, w13.num_experts, w13.out_features, w2.in_features) == (bits, bits, 8, 128, 64)
    assert mlp.gate.quantized is None
    hf_experts = original.model.layers[0].mlp.experts
    for packed, weights in ((w13, hf_experts.gate_up_proj.detach()), (w2, hf_experts.down_proj.detach())):
        # (each expert's matrix in its place: off by the rounding, a small part of the weights' size)
        assert float((_stacked(packed) - weights).abs().max()) < 0.1 * float(weights.abs().max())
    prompts = [[5, 17, 300, 41], list(range(3, 40)), [7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = run_engine(engine, prompts, params)
    reference_dir = write_dequantized_checkpoint(model, model_dir, tmp_path / "dequantized")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    assert tokens == [hf_greedy(hf_model, p, 16, stop_at_eos=False) for p in prompts]


def test_fp8_at_load_is_refused(tmp_path):
    _, model_dir = _saved(tmp_path, "qwen3_moe")
    refusal = (
        r"mixture-of-experts model: .* experts load quantized from GPTQ, AWQ, .* GGUF checkpoints, or are quantized"
    )
    with pytest.raises(ValueError, match=refusal):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16, quantization="fp8"))


def test_a_quantized_checkpoint_is_refused(tmp_path):
    _, model_dir = _saved(tmp_path, "mixtral")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mixture-of-experts model: quantized weights \(fp8"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


def test_qwen_moe_sliding_window_is_refused(tmp_path):
    """HF slides only some Qwen-MoE layers' attention (its layer_types); ours would slide all."""
    _, model_dir = _saved(tmp_path, "qwen3_moe", use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match="use_sliding_window is not supported"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


@pytest.mark.parametrize("name", tiny_models.MOE)
@pytest.mark.parametrize("mode", ["chunked", "preempting"])
def test_prefix_caching_chunks_and_preemption_keep_hfs_tokens(tmp_path, name, mode):
    """Prompts sharing a 40-token prefix, run after the first has cached it: cached prefixes, prompts split
    into chunks (48-token steps), or requests preempted and recomputed (10 KV blocks for prompts of 45 to 70
    and 24 new tokens, in 16-token steps), and every request's greedy tokens still equal HF's."""
    hf_model, model_dir = _saved(tmp_path, name)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (20, 5, 13, 30)]
    expected = [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in prompts]
    # (preempting: 16-token steps too, so that a request's sliding-window groups hold a few blocks, and
    # too few blocks for every request at once: Mixtral's layers all slide over 24 tokens, so a decoding
    # request holds 3 blocks whatever its length, and 10 would hold them all)
    preempting_blocks = 7 if name == "mixtral" else 10
    args = {
        "chunked": dict(max_num_batched_tokens=48, num_kv_blocks=64),
        "preempting": dict(num_kv_blocks=preempting_blocks, max_num_batched_tokens=16),
    }[mode]
    engine = EngineCore(EngineConfig(model=str(model_dir), **args))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = run_engine(engine, prompts[:1], params) + run_engine(engine, prompts[1:], params)
    assert tokens == expected
    stats = engine.scheduler.stats()
    assert stats.prefix_cache_hits >= 3 * 32  # (two whole 16-token blocks of the prefix, three times)
    if mode == "preempting":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("quantization", ["auto", "int4"])
def test_dummy_weights_run_from_a_config_alone(tmp_path, quantization):
    """`load_format="dummy"` (how benchmarks build a model from its config.json) fills the stacked experts,
    quantized at load too (each expert's projections drawn as a checkpoint holds them)."""
    config_cls, extra = tiny_models.ARCHITECTURES["qwen2_moe"]
    model_dir = tmp_path / "config-only"
    config_cls(**{**tiny_models.COMMON, **extra}, architectures=["Qwen2MoeForCausalLM"]).save_pretrained(model_dir)
    config = EngineConfig(model=str(model_dir), load_format="dummy", num_kv_blocks=32, quantization=quantization)
    engine = EngineCore(config)
    mlp = engine.runner.model.decoder_layers()[0].mlp
    assert isinstance(mlp.experts()[0], PackedExperts) == (quantization == "int4")
    w13, w2 = (_stacked(w) for w in mlp.experts())
    assert isinstance(mlp, MoEMLP) and bool(w13.std() > 0) and bool(w2.std() > 0)
    tokens = run_engine(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(tokens[0]) == 8


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bfloat16_runs_and_its_first_tokens_agree_with_float32(tmp_path, name):
    _, model_dir = _saved(tmp_path, name)
    prompts = [[5, 17, 300, 41] * k for k in (1, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {
        dtype: run_engine(
            EngineCore(EngineConfig(model=str(model_dir), dtype=dtype, num_kv_blocks=32)), prompts, params
        )
        for dtype in ("bfloat16", "float32")
    }
    assert all(len(t) == 8 for t in runs["bfloat16"])
    assert [t[0] for t in runs["bfloat16"]] == [t[0] for t in runs["float32"]]


def test_a_moe_decoder_pools_like_hf(tmp_path):
    """`--runner pooling` (whole prompts, no KV cache): the last token's final hidden state equals HF's."""
    from pagoda.engine_core.engine import create_engine
    from pagoda.engine_core.pooling.params import PoolingParams

    hf_model, model_dir = _saved(tmp_path, "qwen3_moe")
    engine = create_engine(EngineConfig(model=str(model_dir), runner="pooling", normalize=False))
    prompts = [[5, 17, 300, 41, 9], list(range(3, 40))]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, pooling=PoolingParams())
    pooled = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            pooled[delta.request_id] = torch.from_numpy(delta.pooled.array()[0].copy())
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(pooled[str(i)], expected, atol=1e-5, rtol=1e-4)
