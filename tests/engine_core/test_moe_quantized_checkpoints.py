"""GPTQ, AWQ and compressed-tensors checkpoints of mixture-of-experts models (engine_core/models/moe.py): their
experts load quantized (`PackedExperts` holding the checkpoint's own integers and scales) and serve like HF.

The checkpoints are written here, not by the quantization tools (GPTQModel, AutoAWQ and llmcompressor quantize
no tiny MoE quickly): the linears of a tiny random model (tests/tiny_models.py) are rounded to nearest in groups
and stored in each format's on-disk layout (the layouts engine_core/quantization/{gptq,awq,compressed_tensors}.py
describe), the routers and the shared expert's gate left in full precision as the tools leave them. The
reference is HF's model holding exactly the weights the checkpoint stands for (its dequantization), so that
only summation order differs; dense checkpoints of these formats are checked against the tools themselves in
test_gptq_awq.py and test_compressed_tensors.py. Then tensor and expert parallel (each rank's partial sums add
up to the whole layer; two worker processes give HF's tokens), and what stays refused, each with an error
naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.loader import load_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.parallel.distributed import SINGLE, TPGroup
from pagoda.engine_core.quantization import resolve_method
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels.quantized import PackedExperts
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine
from tests.moe_quant_checkpoints import (
    Scheme,
    write_checkpoint,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41], list(range(3, 40)), [7] * 20]


def _stacked(experts: PackedExperts) -> torch.Tensor:
    return torch.stack([experts.matrix(e) for e in range(experts.num_experts)])


CASES = [
    ("qwen3_moe", Scheme("gptq", 4, 64, True)),
    ("qwen3_moe", Scheme("gptq", 8, 32, False)),
    ("qwen3_moe", Scheme("awq", 4, 64, False)),
    ("qwen3_moe", Scheme("pack-quantized", 4, 32, True)),
    ("qwen3_moe", Scheme("int-quantized", 8, -1, True)),
    ("qwen2_moe", Scheme("gptq", 4, 32, False)),
    ("qwen2_moe", Scheme("awq", 4, 32, False)),
    ("qwen2_moe", Scheme("pack-quantized", 4, 64, False)),
    ("mixtral", Scheme("gptq", 4, 32, False)),
    ("mixtral", Scheme("pack-quantized", 8, 32, True)),
]


@pytest.mark.parametrize(("name", "scheme"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_experts_load_quantized_and_serve_like_hf_on_the_checkpoints_weights(tmp_path, name, scheme):
    """Each layer's experts are `PackedExperts` of the checkpoint's bits holding exactly its weights (the
    stacked float parameters never allocated), the router stays in float, and the greedy tokens are those of
    HF's model holding the checkpoint's dequantized weights."""
    hf_model = write_checkpoint(tmp_path / "model", name, scheme)
    engine = EngineCore(EngineConfig(model=str(tmp_path / "model"), num_kv_blocks=32))
    model = engine.runner.model
    moe_layers = [(i, layer.mlp) for i, layer in enumerate(model.decoder_layers()) if isinstance(layer.mlp, MoEMLP)]
    assert moe_layers
    for index, mlp in moe_layers:
        w13, w2 = mlp.experts()
        assert isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)
        assert (w13.bits, w2.bits) == (scheme.bits, scheme.bits)
        assert mlp.w13.is_meta and mlp.w2.is_meta
        assert mlp.gate.quantized is None
        hf_experts = hf_model.model.layers[index].mlp.experts
        assert torch.equal(_stacked(w13), hf_experts.gate_up_proj)
        assert torch.equal(_stacked(w2), hf_experts.down_proj)
    if name == "qwen2_moe":  # (the shared expert quantized as a dense MLP; its gate in float)
        shared = moe_layers[0][1]
        assert shared.shared_expert is not None and shared.shared_expert.gate_up_proj.quantized is not None
        assert shared.shared_expert_gate is not None and shared.shared_expert_gate.quantized is None
    tokens = run_engine(engine, PROMPTS, GREEDY)
    with torch.no_grad():
        assert tokens == [hf_greedy(hf_model, p, GREEDY.max_tokens, stop_at_eos=False) for p in PROMPTS]


# --- Tensor and expert parallel ---


def _moe_layer(model_dir, group=SINGLE, expert_parallel=False) -> MoEMLP:
    cfg = ModelConfig.from_dir(model_dir)
    method = resolve_method("auto", cfg.raw)
    model = load_model(
        model_dir, cfg, torch.float32, torch.device("cpu"), quantization=method, group=group,
        expert_parallel=expert_parallel,
    )  # fmt: skip
    mlp = model.decoder_layers()[0].mlp
    assert isinstance(mlp, MoEMLP)
    return mlp


SPLIT_SCHEMES = [Scheme("gptq", 4, 32, False), Scheme("awq", 4, 32, False), Scheme("pack-quantized", 8, 32, True)]


@pytest.mark.parametrize("scheme", SPLIT_SCHEMES, ids=str)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_quantized_experts_split_over_the_ranks(tmp_path, scheme, expert_parallel):
    """Two ranks of a Qwen2-MoE layer (built as workers build them, without the all-reduce): under tensor
    parallel each holds every expert's half of the intermediate rows, cut from the converted experts (gate
    and up rows; the down projection's columns with their groups' scales), under expert parallel half the
    experts whole; either way the checkpoint's own weights, so the partial sums add up to the whole layer."""
    write_checkpoint(tmp_path / "model", "qwen2_moe", scheme)
    whole = _moe_layer(tmp_path / "model")
    ranks = [_moe_layer(tmp_path / "model", TPGroup(rank, 2), expert_parallel) for rank in range(2)]
    for mlp in ranks:
        w13, w2 = mlp.experts()
        assert isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)
        expected = (4, 128, 64) if expert_parallel else (8, 64, 32)  # (experts, w13 rows, w2 columns)
        assert (w13.num_experts, w13.out_features, w2.in_features) == expected
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, parts = whole(x), [mlp(x) for mlp in ranks]
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-5, rtol=1e-4)


def test_groups_straddling_the_ranks_columns_are_refused(tmp_path):
    """Experts of 96 intermediate rows in groups of 32: each of 2 ranks would hold 48 of the down projection's
    columns, half a group's (the group's scale cannot be split): the error names the sizes and the way out;
    expert parallel keeps the experts whole."""
    write_checkpoint(tmp_path / "model", "qwen3_moe", Scheme("gptq", 4, 32, True), moe_intermediate_size=96)
    refusal = r"experts\.\d+\.down_proj: tensor-parallel size 2 gives each rank 48 of its 96 input columns.*size 32"
    with pytest.raises(ValueError, match=refusal):
        _moe_layer(tmp_path / "model", TPGroup(0, 2))
    assert _moe_layer(tmp_path / "model", TPGroup(1, 2), expert_parallel=True).experts()[0].num_experts == 4


@pytest.mark.slow  # (two worker processes over gloo per split)
@pytest.mark.parametrize("split", [{}, {"enable_expert_parallel": True}], ids=["tp2", "ep2"])
def test_split_engines_serve_like_hf_on_the_checkpoints_weights(tmp_path, split):
    """A GPTQ Qwen2-MoE served by two worker processes (tensor parallel, or expert parallel): the greedy tokens
    of HF's model holding the checkpoint's dequantized weights."""
    from tests.helpers import greedy_with_first_logprobs

    hf_model = write_checkpoint(tmp_path / "model", "qwen2_moe", Scheme("gptq", 4, 32, False))
    args = dict(tensor_parallel_size=2, max_num_batched_tokens=48, num_kv_blocks=64, cpu_threads_bind="none")
    tokens, _ = greedy_with_first_logprobs(tmp_path / "model", PROMPTS, GREEDY.max_tokens, **args, **split)
    with torch.no_grad():
        assert tokens == [hf_greedy(hf_model, p, GREEDY.max_tokens, stop_at_eos=False) for p in PROMPTS]


# --- What stays refused ---


def _edit_config(model_dir, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"].update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_act_order_experts_are_refused(tmp_path):
    """GPTQ `desc_act`: a g_idx that scatters each expert's groups over its columns would need a permutation
    of each expert's input, which the fused MoE does not take. A `desc_act` checkpoint whose g_idx keeps the
    groups in order loads."""
    from safetensors.torch import load_file

    model_dir = tmp_path / "model"
    write_checkpoint(model_dir, "qwen3_moe", Scheme("gptq", 4, 32, True))
    _edit_config(model_dir, desc_act=True)
    experts = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16)).runner.model.decoder_layers()[0].mlp
    assert isinstance(experts.experts()[0], PackedExperts)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for key, g_idx in tensors.items():
        if ".experts." in key and key.endswith(".g_idx"):
            tensors[key] = (torch.arange(len(g_idx)) % (len(g_idx) // 32)).to(torch.int32)  # groups interleaved
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.\d+\.\w+_proj: act-order experts \(desc_act"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


def test_experts_left_in_full_precision_are_refused(tmp_path):
    """A checkpoint quantizing the attention but not the experts: the stacked experts are built for the
    quantized layout (never allocated in float), so they cannot hold float weights."""
    model_dir = tmp_path / "model"
    write_checkpoint(model_dir, "qwen3_moe", Scheme("gptq", 4, 32, True), quantize_experts=False)
    with pytest.raises(ValueError, match=r"stores this expert in full precision, and gptq .* does not quantize"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))


def test_fp8_experts_are_refused(tmp_path):
    """compressed-tensors' float-quantized (FP8) weights have no layout of the fused MoE's."""
    model_dir = tmp_path / "model"
    tiny_models.build("qwen3_moe").save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "float-quantized"}},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mixture-of-experts model: quantized weights \(compressed-tensors float"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))
