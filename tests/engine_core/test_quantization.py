"""The quantization seat: method resolution, packing merged/act-order shards, and quantization at load
(`--quantization int8|int4`) serving the real SmolLM2 with the tokens of its own dequantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.loader import load_model, weight_bytes
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.quantization import resolve_method
from pagoda.engine_core.quantization.at_load import quantize_int4_grouped, quantize_int8_per_channel
from pagoda.engine_core.quantization.base import QuantizedShard, pack_shards
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels.quantized import dequantize_original_order, reference_linear
from tests.helpers import golden_prompts
from tests.quantization_helpers import identical_count, write_dequantized_checkpoint

GPTQ_CONFIG = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}


@pytest.mark.parametrize(
    ("flag", "config", "message"),
    [
        ("auto", {"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes', which Pagoda does not"),
        ("none", GPTQ_CONFIG, "--quantization none cannot load it"),
        ("none", {"quantization_config": {"quant_method": "bitsandbytes"}}, "--quantization none cannot load it"),
        ("int4", GPTQ_CONFIG, "already quantized with 'gptq'; --quantization int4 cannot quantize it again"),
        ("wat", {}, "unknown --quantization 'wat'"),
    ],
)
def test_resolution_errors_name_the_problem(flag, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_method(flag, config)


def test_resolution_of_full_precision_checkpoints():
    assert resolve_method("auto", {}) is None
    assert resolve_method("none", {}) is None
    assert resolve_method("int8", {}).name == "int8"
    assert resolve_method("int4", {}).name == "int4"


def test_int4_at_load_keeps_the_lm_head_in_int8():
    method = resolve_method("int4", {})
    weight = torch.randn(8, 96)
    head, body = method.quantize("lm_head", weight), method.quantize("layers.0.mlp.down_proj", weight)
    assert (head.bits, head.group_size) == (8, -1) and (body.bits, body.group_size) == (4, 32)


def test_round_to_nearest_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(40, 200)  # 200 = 3 groups of 64 + a partial one of 8
    shard = quantize_int4_grouped(w, 64)
    step = shard.scales.repeat_interleave(64, dim=1)[:, :200]
    assert bool(((shard.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    shard8 = quantize_int8_per_channel(w)
    assert bool(((shard8.dequantize() - w).abs() <= shard8.scales / 2 + 1e-6).all())


def test_merged_act_order_shards_pack_to_the_same_weights():
    """pack_shards concatenates rows and turns a shared g_idx into a column permutation; the packed
    weight in the original column order equals each shard's own dequantization, and so does the matmul."""
    torch.manual_seed(1)
    k, group = 128, 32
    g_idx = torch.randperm(k) % (k // group)  # each group gets 32 columns, scattered
    shards = []
    for rows in (24, 8, 8):
        q = torch.randint(0, 16, (rows, k))
        # float16 values, as packed: packing changes no weight
        scales, mins = (torch.rand(rows, k // group) + 0.1).half().float(), torch.randn(rows, k // group).half().float()
        shards.append(QuantizedShard(q, scales, mins, bits=4, group_size=group, g_idx=g_idx))
    packed = pack_shards("qkv", shards)
    expected = torch.cat([s.dequantize() for s in shards])
    assert packed.perm is not None
    assert torch.equal(dequantize_original_order(packed), expected)
    x = torch.randn(3, k, dtype=torch.float64)
    got = reference_linear(x.float(), packed).double()
    assert torch.allclose(got, x @ expected.double().t(), atol=1e-4)


def test_merged_shards_quantized_differently_pack_losslessly_or_are_refused():
    """Parts with other group sizes / bits (a Q4_K_M GGUF's Q6_K v_proj) are brought to one layout
    without changing a weight; parts with different act-order cannot share a permutation."""
    torch.manual_seed(2)

    def half(t):  # float16 values, as packed
        return t.half().float()

    a = QuantizedShard(torch.randint(0, 16, (4, 64)), half(torch.rand(4, 2)), half(torch.randn(4, 2)), 4, 32)
    b = QuantizedShard(torch.randint(0, 256, (4, 64)), half(torch.rand(4, 1)), None, bits=8, group_size=64)
    packed = pack_shards("layers.0.self_attn.qkv_proj", [a, b])
    assert (packed.bits, packed.group_size) == (8, 32)
    assert torch.allclose(dequantize_original_order(packed), torch.cat([a.dequantize(), b.dequantize()]), atol=1e-5)
    c = QuantizedShard(a.q, a.scales, a.mins, bits=4, group_size=32, g_idx=torch.arange(64).flip(0) // 32)
    with pytest.raises(ValueError, match="different act-order"):
        pack_shards("layers.0.mlp.gate_up_proj", [a, c])


@pytest.fixture(scope="module")
def float32_weight_bytes(default_model_dir):
    model = load_model(default_model_dir, ModelConfig.from_dir(default_model_dir), torch.float32, torch.device("cpu"))
    return weight_bytes(model)


@pytest.mark.parametrize(("method", "max_ratio"), [("int8", 0.3), ("int4", 0.2)])
def test_quantized_weights_take_the_memory_the_issue_allows(method, max_ratio, default_model_dir, float32_weight_bytes):
    """A property of the layout, not a timing: with float16 scales and mins (kernels/quantized.py), SmolLM2
    quantized at load holds at most 0.3x (int8) / 0.2x (int4) of its float32 weights' bytes."""
    config = ModelConfig.from_dir(default_model_dir)
    model = load_model(
        default_model_dir, config, torch.float32, torch.device("cpu"), quantization=resolve_method(method, {})
    )
    packed = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert len(packed) == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer, and the head
    for weight in packed:
        assert weight.scales.dtype == torch.float16
        assert (weight.mins is None) == (weight.bits == 8)  # int8: symmetric; int4: a min per group
        assert weight.mins is None or weight.mins.dtype == torch.float16
    assert weight_bytes(model) <= max_ratio * float32_weight_bytes, (weight_bytes(model), float32_weight_bytes)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return golden_prompts(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "max_ratio"), [("int8", 0.3), ("int4", 0.22)])
def test_quantized_at_load_serves_its_own_dequantized_weights(method, max_ratio, default_model_dir, prompts, tmp_path):
    """SmolLM2 quantized at load gives the greedy tokens of a float32 checkpoint holding exactly its
    dequantized weights (only summation order differs: at least 9 of 10 prompts x 32 tokens identical),
    first-step logits agree closely, and its weights take the memory the issue allows."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    quantized = LLM(model=str(default_model_dir), quantization=method, num_kv_blocks=256)
    runner = quantized.engine.runner
    assert runner.quantization is not None and runner.quantization.name == method
    quantized_bytes = runner.weight_bytes
    reference_dir = write_dequantized_checkpoint(runner.model, default_model_dir, tmp_path / "dequantized")
    got = quantized.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del quantized
    full = LLM(model=str(reference_dir), num_kv_blocks=256)
    full_bytes = full.engine.runner.weight_bytes
    want = full.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del full
    got_ids = [o.outputs[0].token_ids for o in got]
    want_ids = [o.outputs[0].token_ids for o in want]
    assert identical_count(got_ids, want_ids) >= 9, (got_ids, want_ids)
    for g, w in zip(got, want, strict=True):  # the first step's top logprobs
        first_got, first_want = g.outputs[0].logprobs[0], w.outputs[0].logprobs[0]
        token = w.outputs[0].token_ids[0]
        assert abs(first_got[token].logprob - first_want[token].logprob) < 2e-3
    assert quantized_bytes <= max_ratio * full_bytes, (quantized_bytes, full_bytes)


def test_a_checkpoint_missing_a_linear_is_refused(default_model_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if "layers.3.mlp.down_proj" not in n}  # noqa: SIM118
    save_file(tensors, str(broken / "model.safetensors"))
    assert json.loads((broken / "config.json").read_text())["num_hidden_layers"] > 3
    with pytest.raises(ValueError, match=r"missing the weights of layers\.3\.mlp\.down_proj"):
        LLM(model=str(broken), quantization="int4", num_kv_blocks=16)
