"""The mixture-of-experts families: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is the Llama family's model (engine_core/models/llama.py) with some or all layers' MLP a mixture of
experts (`MoEMLP`), declared through the model's `mlp_for` seat: the attention, norms, rotary embedding,
embedding and LM head are the shared layers. The experts' routing, grouped GEMMs and weighted sum are
one op, `ops.fused_moe` (kernels/torch_ref/moe.py; on CUDA kernels/triton/moe.py).

Checkpoints store each expert's projections apart (`mlp.experts.E.gate_proj` / `up_proj` / `down_proj`;
Mixtral's `block_sparse_moe.experts.E.w1` / `w3` / `w2`); they load straight into the stacked
parameters `w13` [E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I], one view per tensor.

Not yet (refused with an error naming the limit, never run wrong): tensor and pipeline parallel (here,
and before any worker starts in parallel/sharding.py `check_model_splits`), quantized weights, at load or
in the checkpoint (loader.py), GGUF MoE files (gguf_model.py); the fused CPU decode step declines MoE
layers (fused_decode.py), and with Triton turned off CUDA graphs are not captured for them (the reference
op's expert loop reads the routing on the host: cuda_graphs.py `model_capturable`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama import LlamaForCausalLM
from pagoda.engine_core.models.llama_layers import LlamaMLP
from pagoda.engine_core.parallel.distributed import building_group, building_stage
from pagoda.kernels import ops
from pagoda.kernels.torch_ref.moe import Routing

# A checkpoint's per-expert tensor: layer, block name, expert, projection.
_EXPERT = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# projection -> (our stacked parameter, which half of w13: gate 0, up 1; None for w2)
_EXPERT_PROJ = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
    "w1": ("w13", 0),  # Mixtral's names
    "w3": ("w13", 1),
    "w2": ("w2", None),
}


class MoEMLP(nn.Module):
    """A layer's mixture of experts: the router (a replicated Linear [E, H] -> float32 logits), each
    expert's SiLU-gated MLP stacked in `w13` and `w2`, and optionally a shared expert (Qwen2-MoE: a dense
    MLP scaled by sigmoid(shared_expert_gate(x)) and added to the routed sum)."""

    def __init__(self, cfg: ModelConfig, dtype, weights_in_hidden_dtype: bool):
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # (norm_topk_prob is always True for Mixtral: engine_core/model_config.py)
        self.routing = Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob, weights_in_hidden_dtype)
        self.gate = Linear(hidden, experts, False, dtype)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, dtype, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype)

    def shard_count(self, param: torch.Tensor) -> int:
        """Checkpoint tensors per stacked parameter: gate and up of each expert in w13, down in w2."""
        return param.shape[0] * (2 if param is self.w13 else 1)

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` checkpoint shard `index` fills: w13's (expert, half) = divmod(index, 2),
        w2's expert `index`."""
        if param is self.w13:
            expert, half = divmod(index, 2)
            inter = param.shape[1] // 2
            return param[expert, half * inter : (half + 1) * inter]
        return param[index]

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        logits = self.gate(x).float()
        out = ops.fused_moe(x, logits, self.w13, self.w2, self.routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, bulk_rows_from)
            out = out + shared
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose layers `cfg.is_moe_layer` names hold a `MoEMLP`."""

    weights_in_hidden_dtype = True  # (Qwen's routers round the weights to the hidden dtype; Mixtral's do not)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        name = cfg.architecture
        if building_group().parallel:
            raise ValueError(f"{name}: mixture-of-experts models do not run under tensor parallel yet")
        if building_stage().count > 1:
            raise ValueError(f"{name}: mixture-of-experts models do not run under pipeline parallel yet")
        if cfg.raw.get("use_sliding_window") and cfg.raw.get("model_type") in ("qwen2_moe", "qwen3_moe"):
            # (HF's layer_types make only some layers' attention sliding; ours would slide in all)
            raise ValueError(f"{name}: use_sliding_window is not supported for this family yet")
        super().__init__(cfg, dtype, pooling)

    def mlp_for(self, layer_index: int, dtype: torch.dtype) -> nn.Module:
        if not self.cfg.is_moe_layer(layer_index):
            return super().mlp_for(layer_index, dtype)
        return MoEMLP(self.cfg, dtype, self.weights_in_hidden_dtype)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        short = name.removeprefix("model.")
        match = _EXPERT.match(short)
        if match is not None and match[3] in _EXPERT_PROJ:  # (other names: the Llama mapping refuses them)
            layer, expert = match[1], int(match[2])
            if not self._on_this_stage(f"layers.{layer}"):
                return None
            param, half = _EXPERT_PROJ[match[3]]
            return f"layers.{layer}.mlp.{param}", expert if half is None else 2 * expert + half
        return super()._target(name.replace(".block_sparse_moe.", ".mlp."))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """QKV biases (the config's qkv_bias) and a shared expert in every MoE layer."""


class MixtralForCausalLM(MoEForCausalLM):
    weights_in_hidden_dtype = False
