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
import re
from dataclasses import dataclass

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
from pagoda.engine_core.quantization.awq import PACK_ORDER
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels.quantized import PackedExperts
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41], list(range(3, 40)), [7] * 20]
# The linears a checkpoint quantizes: attention, and the dense and shared experts' MLPs (the experts are
# stacked in HF's model and handled apart); the routers (`mlp.gate`), the shared expert's gate, the
# embeddings and the LM head stay in full precision.
_QUANTIZED_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj)\.weight$")
_GPTQ_V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # one in each field (engine_core/quantization/gptq.py)
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's expert projections' names


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint is quantized: `format` gptq | awq | pack-quantized | int-quantized (compressed-tensors)."""

    format: str
    bits: int
    group_size: int  # -1: one group per output row
    symmetric: bool

    def __str__(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.format}-w{self.bits}-{group}-{'sym' if self.symmetric else 'asym'}"


def round_to_nearest(weight: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] unsigned integers, scales [N, G] in the format's float dtype, zero points [N, G] unsigned):
    weight ~= scales * (q - zeros), groups of consecutive input columns. Symmetric: the zero point is the
    middle value 2**(bits-1)."""
    n, k = weight.shape
    group = k if scheme.group_size == -1 else scheme.group_size
    grouped = weight.float().reshape(n, k // group, group)
    top = (1 << scheme.bits) - 1
    scale_dtype = torch.bfloat16 if scheme.format in ("pack-quantized", "int-quantized") else torch.float16
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if scheme.symmetric:
        scales = torch.maximum(-low, high) / ((1 << (scheme.bits - 1)) - 1)
    else:
        scales = (high - low) / top
    scales = scales.clamp(min=1e-4).to(scale_dtype)  # (what is stored: the weights are rounded against it)
    if scheme.symmetric:
        zeros = torch.full((n, k // group), 1 << (scheme.bits - 1), dtype=torch.int64)
    else:
        zeros = torch.round(-low / scales.float()).clamp(0, top).long()
    q = torch.round(grouped / scales.float()[..., None]) + zeros[..., None]
    return q.clamp(0, top).long().reshape(n, k), scales, zeros


def dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight the checkpoint stands for (exact: a 16-bit scale times an integer of at most 9 bits)."""
    n, k = q.shape
    groups = scales.shape[1]
    grouped = (q.reshape(n, groups, k // groups) - zeros[..., None]).float() * scales.float()[..., None]
    return grouped.reshape(n, k)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `bits`-bit values [R, C] -> int32 [R, ceil(C * bits / 32)], value j of each word in its bits
    [j * bits, (j + 1) * bits) (GPTQ's, AWQ's and compressed-tensors' packing, along the last dimension)."""
    per_word = 32 // bits
    rows, columns = values.shape
    padded = torch.zeros(rows, -(-columns // per_word) * per_word, dtype=torch.int64)
    padded[:, :columns] = values
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (padded.reshape(rows, -1, per_word) << shifts).sum(-1)
    return as_int32(words)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits (possibly negative, after a subtraction) as int32, wrapped as C wraps them."""
    return ((words & 0xFFFFFFFF) - ((words & 0x80000000) << 1)).to(torch.int32)


def checkpoint_tensors(name: str, weight: torch.Tensor, scheme: Scheme) -> tuple[dict, torch.Tensor]:
    """The checkpoint tensors of linear `name` ([N, K] float weight) in `scheme`'s layout, by full name,
    and the float32 weight they stand for."""
    q, scales, zeros = round_to_nearest(weight, scheme)
    n, k = q.shape
    bits = scheme.bits
    if scheme.format == "gptq":  # qweight [K / pf, N] packed along K; qzeros [G, N / pf] v1 (stored minus one)
        zero_words = pack_int32(zeros.t(), bits).long() - _GPTQ_V1_ZERO_OFFSET[bits]
        tensors = {
            "qweight": pack_int32(q, bits).t().contiguous(),
            "qzeros": as_int32(zero_words),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(k) // (k if scheme.group_size == -1 else scheme.group_size)).to(torch.int32),
        }
    elif scheme.format == "awq":  # [K, N / 8], each word's eight columns in AWQ's interleaved order
        order = list(PACK_ORDER)
        interleaved = q.t().reshape(k, n // 8, 8)[..., order].reshape(k, n)
        zero_fields = zeros.t().reshape(-1, n // 8, 8)[..., order].reshape(-1, n)
        tensors = {
            "qweight": pack_int32(interleaved, bits),
            "qzeros": pack_int32(zero_fields, bits),
            "scales": scales.t().contiguous(),
        }
    elif scheme.format == "pack-quantized":  # q + 2**(bits-1) of the signed q: our unsigned q, packed along K
        tensors = {
            "weight_packed": pack_int32(q, bits),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            "weight_scale": scales,
        }
        if not scheme.symmetric:  # signed zero points, offset the same way and packed along the rows
            tensors["weight_zero_point"] = pack_int32(zeros.t(), bits).t().contiguous()
    else:  # int-quantized: the signed int8 weight itself
        tensors = {"weight": (q - 128).to(torch.int8), "weight_scale": scales}
    return {f"{name}.{kind}": tensor for kind, tensor in tensors.items()}, dequantized(q, scales, zeros)


def quantization_config(scheme: Scheme) -> dict:
    if scheme.format == "gptq":
        return {
            "quant_method": "gptq",
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "sym": scheme.symmetric,
            "desc_act": False,
            "checkpoint_format": "gptq",
        }
    if scheme.format == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": scheme.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["gate"],
        }
    weights = {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric}
    if scheme.group_size == -1:
        weights["strategy"] = "channel"
    else:
        weights.update(strategy="group", group_size=scheme.group_size)
    inputs = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": inputs if scheme.format == "int-quantized" else None,
        "output_activations": None,
        "format": scheme.format,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
    }


def write_checkpoint(out, name: str, scheme: Scheme, quantize_experts: bool = True, **overrides):
    """Tiny model `name` saved as a `scheme` checkpoint in `out`, its experts named as the Hub's checkpoints
    name them (Qwen-MoE: `mlp.experts.E.{gate,up,down}_proj`; Mixtral: `block_sparse_moe.experts.E.{w1,w3,w2}`
    and its router `block_sparse_moe.gate`); returns HF's model holding the weights the checkpoint stands for."""
    model = tiny_models.build(name, **overrides)
    model.save_pretrained(out)
    mixtral = name == "mixtral"
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            prefix = key.rpartition(".")[0].replace(".mlp.", ".block_sparse_moe." if mixtral else ".mlp.")
            if key.endswith(".mlp.experts.gate_up_proj") or key.endswith(".mlp.experts.down_proj"):
                projections = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
                size = value.shape[1] // len(projections)  # (gate_up_proj: gate rows, then up rows)
                for expert in range(value.shape[0]):
                    for i, projection in enumerate(projections):
                        rows = slice(i * size, (i + 1) * size)
                        linear = f"{prefix}.{expert}.{_MIXTRAL[projection] if mixtral else projection}"
                        if not quantize_experts:
                            tensors[f"{linear}.weight"] = value[expert, rows].clone()
                            continue
                        stored, exact = checkpoint_tensors(linear, value[expert, rows], scheme)
                        tensors.update(stored)
                        value[expert, rows] = exact
            elif _QUANTIZED_LINEAR.search(key):
                stored, exact = checkpoint_tensors(key.removesuffix(".weight"), value, scheme)
                tensors.update(stored)
                value.copy_(exact)
            else:
                tensors[key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral else key] = value.clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return model


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
