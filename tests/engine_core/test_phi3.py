"""Phi-3 (`Phi3ForCausalLM`, engine_core/models/phi3.py) on tiny random checkpoints (tests/tiny_models.py's phi3)
that store their projections fused (qkv_proj, gate_up_proj), with LongRoPE over an original context of 64
positions, a sliding window of 24 and, Phi-4-mini's way, optionally a partial rotary factor of 0.75 and tied
embeddings.

LongRoPE's factors are chosen once per engine, by the context it serves (engine_core/layers/rotary.py): an
engine of at most 64 positions uses the short factors and gives HF's tokens for prompts and generations
within them; an engine of 1,024 uses the long ones and gives HF's tokens for prompts longer than 64 (HF then
uses the long factors throughout), and for shorter prompts those of HF with the long factors only (where HF
itself would start with the short ones: the divergence rotary.py documents). The tables equal HF's rotary
embedding in both cases. Then chunked
prefill, int8 at load (against our float engine on its dequantized weights, the convention of
test_quantization.py), GPTQ / AWQ / compressed-tensors checkpoints of fused projections (against HF holding
the checkpoint's dequantized weights), and two tensor-parallel ranks over gloo against one.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.layers.linear import MergedLinear
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.phi3 import Phi3ForCausalLM, phi3_rope_scaling
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels.quantized import dequantize_original_order
from tests import tiny_models
from tests.engine_core.phi3_variants import HEAD_DIM, ORIGINAL, VARIANTS
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine
from tests.moe_quant_checkpoints import Scheme, checkpoint_tensors, quantization_config
from tests.parallel_checks import compare_runs
from tests.quantization_helpers import identical_count, write_dequantized_checkpoint


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request, tmp_path_factory):
    """(variant, HF model, its saved directory)."""
    model = tiny_models.build("phi3", **VARIANTS[request.param])
    model_dir = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(model_dir)
    return request.param, model, model_dir


def _prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _fused_pairs(layer, hf_layer) -> list[tuple[MergedLinear, torch.nn.Linear]]:
    """A decoder layer's merged linears and HF's fused ones: (qkv_proj, qkv_proj), (gate_up_proj, gate_up_proj)."""
    return [
        (layer.self_attn.qkv_proj, hf_layer.self_attn.qkv_proj),
        (layer.mlp.gate_up_proj, hf_layer.mlp.gate_up_proj),
    ]


def test_the_checkpoint_is_fused_and_loads_into_the_merged_linears(phi3):
    _, hf_model, model_dir = phi3
    with open(model_dir / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["sliding_window"] == 24
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    model = engine.runner.model
    assert isinstance(model, Phi3ForCausalLM)
    layer, hf_layer = model.decoder_layers()[0], hf_model.model.layers[0]
    attention = layer.self_attn
    assert isinstance(attention.qkv_proj, MergedLinear) and attention.attn.sliding_window == 24
    for ours, theirs in _fused_pairs(layer, hf_layer):
        weight = ours.panels.unpack() if ours.panels is not None else ours.weight
        assert torch.equal(weight, theirs.weight)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_tables_equal_hf(tmp_path, variant, long):
    """Our cos/sin table against HF's Phi3RotaryEmbedding: the short factors (an engine of at most the original
    context) against HF's call over positions within it, the long ones against a call past it."""
    model = tiny_models.build("phi3", **VARIANTS[variant])
    model.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    scaling = phi3_rope_scaling(cfg)
    rotary_dim = int(HEAD_DIM * scaling.pop("partial_rotary_factor"))
    context = cfg.max_position_embeddings if long else ORIGINAL
    ours = RotaryEmbedding(HEAD_DIM, cfg.max_position_embeddings, cfg.rope_theta, scaling, True, rotary_dim, context)
    positions = torch.arange(3 * ORIGINAL if long else ORIGINAL)[None]
    cos, sin = Phi3RotaryEmbedding(model.config)(torch.zeros(1, dtype=torch.float32), positions)
    half = rotary_dim // 2
    assert cos.shape[-1] == rotary_dim
    table = ours.cos_sin_cache[: positions.shape[1]]
    assert torch.equal(table[:, :half], cos[0, :, :half]) and torch.equal(table[:, half:], sin[0, :, :half])
    assert (ours.cos_sin_cache[0, :half] > 1.0).all()  # (the attention factor, sqrt(1 + ln 16 / ln 64))


def test_a_legacy_config_reads_as_transformers_5_writes_it(tmp_path):
    """Configs written before transformers 5 (Phi-3-mini-128k's): `rope_scaling` of type `su`, the original
    context and the partial rotary factor at the top level; the same scaling as the new layout's."""
    model = tiny_models.build("phi3", **VARIANTS["phi4-mini"])
    model.save_pretrained(tmp_path / "new")
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    config["original_max_position_embeddings"] = rope.pop("original_max_position_embeddings")
    config["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(config))
    legacy = phi3_rope_scaling(ModelConfig.from_dir(tmp_path / "legacy"))
    assert legacy == phi3_rope_scaling(ModelConfig.from_dir(tmp_path / "new"))
    assert legacy["rope_type"] == "longrope" and legacy["original_max_position_embeddings"] == ORIGINAL
    assert legacy["partial_rotary_factor"] == 0.75


def test_greedy_matches_hf_within_the_original_context(phi3):
    """An engine serving at most the original context: the short factors, as HF's for every token of a
    generation that stays within it. Prompts past the sliding window, chunked (16 tokens a step)."""
    _, hf_model, model_dir = phi3
    prompts = _prompts(1, 9, 30, 40)
    expected = [hf_greedy(hf_model, p, 20, stop_at_eos=False) for p in prompts]
    config = EngineConfig(model=str(model_dir), max_model_len=ORIGINAL, max_num_batched_tokens=16, num_kv_blocks=32)
    assert run_engine(EngineCore(config), prompts, _greedy(20)) == expected


def test_greedy_matches_hf_past_the_original_context(phi3):
    """An engine serving 1,024 positions: the long factors, as HF's for a prompt longer than the original
    context. Chunked prefill (48 tokens a step) through the sliding window."""
    _, hf_model, model_dir = phi3
    prompts = _prompts(65, 90, 130)
    expected = [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in prompts]
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=48, num_kv_blocks=64)
    assert run_engine(EngineCore(config), prompts, _greedy(24)) == expected


def test_an_engine_of_a_longer_context_uses_the_long_factors_for_short_prompts_too(phi3):
    """The divergence from HF, pinned: a prompt within the original context, served by an engine of 1,024
    positions, gets the long factors at every position (HF would use the short ones until position 64): its
    tokens are those of HF's model whose short factors are the long ones."""
    variant, _, model_dir = phi3
    overrides = dict(VARIANTS[variant])
    rope = overrides["rope_scaling"]
    overrides["rope_scaling"] = {**rope, "short_factor": rope["long_factor"]}
    long_only = tiny_models.build("phi3", **overrides)  # (seed 0: the same weights)
    prompts = _prompts(9, 30)
    expected = [hf_greedy(long_only, p, 20, stop_at_eos=False) for p in prompts]
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=16, num_kv_blocks=32)
    assert run_engine(EngineCore(config), prompts, _greedy(20)) == expected


def test_int8_at_load_serves_its_own_dequantized_weights(phi3, tmp_path):
    """The fused projections quantized at load as one linear each, then cut: the tokens of our float engine
    on a checkpoint of the dequantized weights (only summation order differs), first logprobs close."""
    _, hf_model, model_dir = phi3
    prompts = _prompts(5, 40, 100)
    engine = EngineCore(EngineConfig(model=str(model_dir), quantization="int8", num_kv_blocks=64))
    layer, hf_layer = engine.runner.model.decoder_layers()[0], hf_model.model.layers[0]
    for ours, theirs in _fused_pairs(layer, hf_layer):  # (each row within int8 rounding of HF's: cut in place)
        assert ours.quantized is not None and ours.quantized.bits == 8
        error = (dequantize_original_order(ours.quantized) - theirs.weight).abs().amax(dim=1)
        assert (error <= theirs.weight.abs().amax(dim=1) / 254 * 1.01).all()
    reference_dir = write_dequantized_checkpoint(engine.runner.model, model_dir, tmp_path / "dequantized")
    got = greedy_with_first_logprobs(model_dir, prompts, 24, quantization="int8", num_kv_blocks=64)
    want = greedy_with_first_logprobs(reference_dir, prompts, 24, num_kv_blocks=64)
    assert identical_count(got[0], want[0]) >= len(prompts) - 1, (got[0], want[0])
    for first_got, first_want in zip(got[1], want[1], strict=True):
        token = max(first_want, key=first_want.__getitem__)
        assert abs(first_got[token] - first_want[token]) < 2e-3


def _write_quantized(out, scheme: Scheme) -> torch.nn.Module:
    """The phi3 variant saved as a `scheme` checkpoint (tests/engine_core/test_moe_quantized_checkpoints.py's
    layouts) whose fused projections are quantized as one linear each, as the tools quantize Phi-3; returns HF's
    model holding the weights the checkpoint stands for."""
    model = tiny_models.build("phi3", **VARIANTS["phi3"])
    model.save_pretrained(out)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
                stored, exact = checkpoint_tensors(key.removesuffix(".weight"), value, scheme)
                tensors.update(stored)
                value.copy_(exact)
            else:
                tensors[key] = value.clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return model


QUANTIZED = [Scheme("gptq", 4, 32, False), Scheme("awq", 4, 32, False), Scheme("pack-quantized", 8, -1, True)]


@pytest.mark.parametrize("scheme", QUANTIZED, ids=str)
def test_quantized_checkpoints_of_fused_projections_serve_like_hf(tmp_path, scheme):
    """GPTQ, AWQ and compressed-tensors tensors of a fused qkv_proj / gate_up_proj are converted whole and cut
    into the merged parts: the checkpoint's bits, HF's tokens on its dequantized weights."""
    hf_model = _write_quantized(tmp_path / "model", scheme)
    prompts = _prompts(70, 100)  # (past the original context: the long factors, as HF's)
    expected = [hf_greedy(hf_model, p, 16, stop_at_eos=False) for p in prompts]
    engine = EngineCore(EngineConfig(model=str(tmp_path / "model"), num_kv_blocks=32))
    qkv = engine.runner.model.decoder_layers()[0].self_attn.qkv_proj
    assert qkv.quantized is not None and qkv.quantized.bits == scheme.bits
    assert run_engine(engine, prompts, _greedy(16)) == expected


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_two_tensor_parallel_ranks_give_one_ranks_tokens(phi3, quantization):
    """Each rank takes its heads' rows of q, k and v and its rows of gate and of up out of the fused tensors
    (quantized: cut after conversion); prompts within and past the original context and the sliding window."""
    _, _, model_dir = phi3
    prompts = _prompts(1, 30, 100)
    args = dict(quantization=quantization, max_num_batched_tokens=48, num_kv_blocks=64)
    runs = [greedy_with_first_logprobs(model_dir, prompts, 16, tensor_parallel_size=tp, **args) for tp in (1, 2)]
    compare_runs(runs, min_identical=len(prompts))
