"""Shared by the quantization tests: a float32 checkpoint holding exactly the weights a quantized model
computes with (the reference a quantized model's greedy tokens are compared with, so that only
summation order differs), and the comparison itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.kernels.quantized import dequantize_original_order

# Our merged linears -> the checkpoint's projections, in shard order.
_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # (Qwen3.5's linear attention)
}
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


def write_dequantized_checkpoint(model: torch.nn.Module, source_dir: Path, target_dir: Path) -> Path:
    """Write `model`'s weights (quantized linears and experts dequantized) as a float32 HF checkpoint, with the
    config and tokenizer of `source_dir` minus any quantization_config."""
    import json

    target_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    tied = getattr(model, "embed_tokens", None) is None
    for path, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if module.quantized is not None:
            weight = dequantize_original_order(module.quantized).float()
        else:  # (a linear kept in full precision: an MoE router, in the CPU matmul's panels once packed)
            weight = (module.panels.unpack() if module.panels is not None else module.weight).float()
        pieces = [(path, weight, module.bias)]
        if isinstance(module, MergedLinear):
            parent, _, leaf = path.rpartition(".")
            pieces = [
                (
                    f"{parent}.{name}",
                    module.shard(i, weight),
                    None if module.bias is None else module.shard(i, module.bias),
                )
                for i, name in enumerate(_SHARDS[leaf][: len(module.out_sizes)])  # (Q and K alone: Gemma 4)
            ]
        for name, w, b in pieces:
            checkpoint = "model.embed_tokens" if (name == "lm_head" and tied) else (
                name if name == "lm_head" else f"model.{name}")  # fmt: skip
            tensors[f"{checkpoint}.weight"] = w.contiguous().clone()
            if b is not None:
                tensors[f"{checkpoint}.bias"] = b.float().contiguous().clone()
    for path, module in model.named_modules():
        if isinstance(module, MoEMLP):  # (each expert's projections, by Qwen-MoE's checkpoint names)
            w13, w2 = module.experts()
            for e in range(_num_experts(w13)):
                gate_up = _expert_matrix(w13, e)
                inter = gate_up.shape[0] // 2
                tensors[f"model.{path}.experts.{e}.gate_proj.weight"] = gate_up[:inter].contiguous().clone()
                tensors[f"model.{path}.experts.{e}.up_proj.weight"] = gate_up[inter:].contiguous().clone()
                tensors[f"model.{path}.experts.{e}.down_proj.weight"] = _expert_matrix(w2, e).contiguous().clone()
    for name, param in model.named_parameters():
        module_path = name.rpartition(".")[0]
        if isinstance(model.get_submodule(module_path) if module_path else None, Linear | MoEMLP):
            continue
        tensors["model.embed_tokens.weight" if name == "embed_tokens" else f"model.{name}"] = param.float().clone()
    save_file(tensors, str(target_dir / "model.safetensors"))
    for name in _COPIED:
        if (source_dir / name).exists():
            shutil.copy(source_dir / name, target_dir / name)
    config = json.loads((source_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("compression_config", None)
    config["torch_dtype"] = "float32"
    (target_dir / "config.json").write_text(json.dumps(config, indent=2))
    return target_dir


def _num_experts(weights) -> int:
    return weights.shape[0] if isinstance(weights, torch.Tensor) else weights.num_experts


def _expert_matrix(weights, expert: int) -> torch.Tensor:
    return (weights[expert] if isinstance(weights, torch.Tensor) else weights.matrix(expert)).float()


def identical_count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))
