"""GPTQ and AWQ checkpoints written by the real tools (GPTQModel, AutoAWQ: see tests/gptq_awq_checkpoints.py).

For each checkpoint: Pagoda's greedy tokens and first-step logprobs against HF transformers loading the
same checkpoint (AWQ: against the float32 weights of AutoAWQ's own dequantization, HF's AWQ kernel
computing in float16), and each layer's dequantization against the tool's own. Then what is not
supported: each gives one clear error before anything is served.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.quantization import resolve_method
from pagoda.engine_core.quantization.base import pack_shards
from pagoda.engine_core.quantization.gptq import GPTQ, unpack_words
from pagoda.kernels.quantized import dequantize
from tests import tool_runs
from tests.gptq_awq_checkpoints import BY_NAME, SPECS, checkpoint, prompt_ids, tool_reference
from tests.helpers import greedy_with_first_logprobs

NEW_TOKENS = 32
TOP_LOGPROBS = 20
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# Largest difference of a first-step logprob (Pagoda's top 20) from the reference's. Pagoda and the
# reference both multiply float32 activations by exact float32 weights: only summation order differs.
LOGPROB_TOLERANCE = 1e-3
# HF's AWQ kernel (GPTQModel's torch_awq) rounds the activations to float16 before each matmul: measured
# up to 0.038 (tiny random models) and 0.009 (SmolLM2's first layers) from Pagoda's float32; a wrong
# unpacking is off by whole units.
HF_AWQ_LOGPROB_TOLERANCE = 0.15


def checked_layers(num_layers: int) -> list[str]:
    """Every linear of the first and the last decoder layer."""
    return [f"model.layers.{i}.{linear}" for i in (0, num_layers - 1) for linear in LINEARS]


def read_linear(model_dir, name: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if key.rpartition(".")[0] == name:
                    tensors[key.rpartition(".")[2]] = f.get_tensor(key)
    return tensors


def pagoda_greedy(model_dir, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens, and the first step's top logprobs {token: logprob}, of each prompt."""
    return greedy_with_first_logprobs(model_dir, prompts, NEW_TOKENS, TOP_LOGPROBS, max_num_batched_tokens=256)


@pytest.fixture(scope="module", params=[spec.name for spec in SPECS])
def made(request):
    """(spec, checkpoint directory, prompts, what the tools make of it) for each checkpoint."""
    spec = BY_NAME[request.param]
    model_dir = checkpoint(spec)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    prompts = prompt_ids(spec.source)
    reference = tool_reference(spec, model_dir, prompts, NEW_TOKENS, checked_layers(num_layers))
    return spec, model_dir, prompts, reference


def largest_difference(first: list[dict[int, float]], reference: list) -> float:
    """Over each prompt's top tokens, the largest |logprob - the reference's| (the reference: a full
    logprob vector, or top tokens of its own, compared where both have the token)."""
    return max(
        abs(logprob - float(theirs[token]))
        for ours, theirs in zip(first, reference, strict=True)
        for token, logprob in ours.items()
        if isinstance(theirs, torch.Tensor) or token in theirs
    )


@pytest.mark.slow
def test_greedy_tokens_and_first_logprobs_match_the_reference(made):
    """GPTQ: against HF transformers on the same checkpoint (its kernel with the scales in float32, so
    that its weights are exact too). AWQ: HF's kernel computes in float16, so against Pagoda serving the
    float32 weights of AutoAWQ's own dequantization; and loosely against HF."""
    spec, model_dir, prompts, reference = made
    tokens, first = pagoda_greedy(model_dir, prompts)
    if spec.tool == "gptq":
        expected_tokens, expected_first = reference["tokens"], list(reference["first_logprobs"])
    else:
        expected_tokens, expected_first = pagoda_greedy(reference["float32_dir"], prompts)
        hf_worst = largest_difference(first, list(reference["first_logprobs"]))
        assert hf_worst <= HF_AWQ_LOGPROB_TOLERANCE, f"first-step logprobs differ from HF's by {hf_worst:.4f}"
    same = [ours == theirs for ours, theirs in zip(tokens, expected_tokens, strict=True)]
    assert sum(same) >= 9, f"{sum(same)}/10 prompts gave the reference's {NEW_TOKENS} tokens: {same}"
    worst = largest_difference(first, expected_first)
    assert worst <= LOGPROB_TOLERANCE, f"first-step logprobs differ from the reference's by up to {worst:.2e}"


@pytest.mark.slow
def test_each_layer_dequantizes_exactly_as_the_tool_does(made):
    _, model_dir, _, reference = made
    method = resolve_method("auto", json.loads((model_dir / "config.json").read_text()))
    assert reference["dequantized"], "the tool dequantized no layer"
    for name, expected in reference["dequantized"].items():
        shard = method.from_checkpoint(name, read_linear(model_dir, name), *expected.shape)
        assert torch.equal(shard.dequantize(), expected), name
        # And after packing for the kernels: the columns in act-order when there is one.
        packed = pack_shards(name, [shard])
        columns = expected if packed.perm is None else expected[:, packed.perm]
        assert torch.equal(dequantize(packed), columns), name


@pytest.mark.slow
def test_act_order_is_shared_by_merged_projections():
    """GPTQ orders a layer's columns by its inputs' Hessian: q/k/v see the same input, and so do gate/up,
    so each merged linear has one permutation (Pagoda's packed layout holds one per linear)."""
    model_dir = checkpoint(BY_NAME["gptq-smollm2-4layers-w4-g64-actorder"])
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            g_idx = [read_linear(model_dir, f"{prefix}.{linear}")["g_idx"] for linear in group]
            assert all(torch.equal(g, g_idx[0]) for g in g_idx), f"{prefix}: {group} differ in g_idx"
            assert not torch.equal(g_idx[0].long(), torch.arange(len(g_idx[0])) // 64), "not act-order"
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj.quantized
    assert qkv is not None and qkv.perm is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "description"),
    [
        ("gptq-smollm2-4layers-w4-g64-actorder", "gptq (4-bit, group 64, symmetric, act-order)"),
        ("gptq-smollm2-4layers-w4-perchannel", "gptq (4-bit, per channel, symmetric)"),
        ("awq-tiny-qwen2-g128", "awq (4-bit, group 128, zero points, gemm)"),
    ],
)
def test_the_method_is_described(name, description):
    model_dir = checkpoint(BY_NAME[name])
    assert resolve_method("auto", json.loads((model_dir / "config.json").read_text())).describe() == description


# --- What is not supported: one clear error, before anything is served ---


@pytest.mark.parametrize(
    ("qcfg", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ 3-bit .* 4- and 8-bit"),
        ({"quant_method": "gptq", "bits": 2, "group_size": 128}, r"GPTQ 2-bit .* 4- and 8-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, r"group_size 48 .* multiple of 32 or -1"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"group_size 16 .* multiple of 32"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"checkpoint_format 'marlin' .* gptq and gptq_v2",
        ),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, r"Marlin"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, r"pack_dtype 'int16'"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {r"+:.*down": {"bits": 8}}},
            r"per-module overrides",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"AWQ version 'gemv' .* 'gemm'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, r"'exllama' .* 'gemm'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"}, r"'gemv_fast'"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, r"AWQ 8-bit .* 4-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 100, "version": "gemm"}, r"group_size 100 .* multiple"),
        ({"quant_method": "awq", "bits": 4, "group_size": -1, "version": "gemm"}, r"group_size -1 .* multiple of 32$"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, r"zero_point: false"),
    ],
)
def test_unsupported_configurations_are_named(qcfg, message):
    with pytest.raises(ValueError, match=message):
        resolve_method("auto", {"quantization_config": qcfg})


def test_a_quantized_checkpoint_refuses_another_quantization():
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    with pytest.raises(ValueError, match=r"already quantized with 'gptq'; --quantization int8 cannot quantize it"):
        resolve_method("int8", config)
    with pytest.raises(ValueError, match=r"already quantized with 'gptq'; --quantization awq cannot load it"):
        resolve_method("awq", config)
    with pytest.raises(ValueError, match=r"--quantization gptq: the checkpoint is not quantized with it"):
        resolve_method("gptq", {})


def test_v1_zero_points_undo_gptqmodels_whole_word_subtraction():
    """GPTQModel writes v1 zero points by subtracting 0x11111111 from each packed word (its
    convert_gptq_v2_to_v1_format): a zero point of 0 borrows from the field above. Unpacking and adding
    one per field would then be wrong for that neighbour; adding back on the whole word is not."""
    zeros = torch.tensor([[0, 5, 0, 15, 8, 0, 1, 0]], dtype=torch.int64)  # one word of eight 4-bit fields
    v2_word = int((zeros[0] << torch.arange(0, 32, 4)).sum())
    v1_word = (v2_word - 0x11111111) & 0xFFFFFFFF
    v1 = torch.tensor([[v1_word - (1 << 32) if v1_word >= 1 << 31 else v1_word]], dtype=torch.int32)
    per_field = (unpack_words(v1, 4).reshape(1, 8) + 1) & 15
    assert not torch.equal(per_field.long(), zeros)  # the borrow broke the naive reading
    method = GPTQ(bits=4, group_size=-1, sym=False, desc_act=False, checkpoint_format="gptq")
    q = torch.zeros(4, 8, dtype=torch.int32)  # K = 32 rows of zeros, packed 8 per word
    shard = method.from_checkpoint(
        "layer", {"qweight": q, "qzeros": v1, "scales": torch.ones(1, 8, dtype=torch.float16)}, 8, 32
    )
    assert shard.mins is not None and torch.equal(shard.mins[:, 0], -zeros[0].float())


def test_a_missing_tool_venv_fails_with_the_command_that_makes_it(monkeypatch, tmp_path):
    monkeypatch.setitem(tool_runs.VENVS, "gptq", tmp_path / ".venv-gptq")
    with pytest.raises(pytest.fail.Exception, match=r"run `make tool-venvs`"):
        tool_runs.tool_python("gptq")


@pytest.mark.slow
def test_a_real_v1_checkpoint_has_borrowed_zero_points():
    """The tiny Mistral's positive-only groups get a zero point of 0 (stored as -1): the per-layer test
    then checks the borrow against GPTQModel's own dequantization."""
    model_dir = checkpoint(BY_NAME["gptq-tiny-mistral-w4-g32-asym"])
    qzeros = read_linear(model_dir, "model.layers.0.self_attn.o_proj")["qzeros"]
    zeros = unpack_words(qzeros.to(torch.int64) + 0x11111111, 4)
    per_field = (unpack_words(qzeros, 4) + 1) & 15
    assert int((zeros == 0).sum()) > 0 and not torch.equal(zeros, per_field)


@pytest.fixture
def tiny_gptq(tmp_path):
    """A copy of a tool-made tiny GPTQ checkpoint, to break."""
    source = checkpoint(BY_NAME["gptq-tiny-qwen2-w4-g64"])
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def _edit_quantization_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"].update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bits": 3}, r"GPTQ 3-bit weights are not supported"),
        ({"group_size": 40}, r"GPTQ group_size 40 is not supported"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
        # Tensors that do not match what config.json says: the layer and both shapes are named.
        ({"bits": 8}, r"layers.0.mlp.down_proj.qweight: shape \(32, 128\), expected \(64, 128\)"),
        ({"group_size": 32}, r"layers.0.mlp.down_proj.qzeros: shape \(4, 16\), expected \(8, 16\)"),
    ],
)
def test_a_checkpoint_pagoda_cannot_load_fails_at_start(tiny_gptq, changes, message):
    _edit_quantization_config(tiny_gptq, **changes)
    with pytest.raises(ValueError, match=message):
        EngineCore(EngineConfig(model=str(tiny_gptq), num_kv_blocks=16))


@pytest.mark.slow
def test_int8_on_a_gptq_checkpoint_fails_at_start(tiny_gptq):
    with pytest.raises(ValueError, match=r"already quantized with 'gptq'; --quantization int8 cannot"):
        EngineCore(EngineConfig(model=str(tiny_gptq), quantization="int8", num_kv_blocks=16))


@pytest.mark.slow
def test_a_truncated_checkpoint_fails_at_start(tiny_gptq):
    weights = tiny_gptq / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a complete safetensors file"):
        EngineCore(EngineConfig(model=str(tiny_gptq), num_kv_blocks=16))
