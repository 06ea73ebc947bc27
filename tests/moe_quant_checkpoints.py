"""Mixture-of-experts checkpoints in the GPTQ, AWQ and compressed-tensors layouts, written here (the tools
quantize no tiny MoE quickly): a tiny model's linears rounded to nearest in groups and stored in each format's
on-disk layout (tests/engine_core/test_moe_quantized_checkpoints.py says why; test_phi3.py writes its fused
projections with them too)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from pagoda.engine_core.quantization.awq import PACK_ORDER
from tests import tiny_models

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
