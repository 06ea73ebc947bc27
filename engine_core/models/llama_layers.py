"""The Llama family's decoder layer and its parts (attention, MLP, RMSNorm), which the model
(engine_core/models/llama.py) is built from and whose tensors the fused CPU decode path reads
(engine_core/models/fused_decode.py)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.engine_core.layers.attention import Attention, AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.parallel.sharding import AttentionHeads
from pagoda.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, qk_norm: bool, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        heads = AttentionHeads(cfg.num_heads, cfg.num_kv_heads)
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias, dtype, parallel="column", heads=heads
        )
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, parallel="row", heads=heads)
        # This rank's heads (all of them without tensor parallel).
        self.num_heads, self.num_kv_heads = (size // self.head_dim for size in self.qkv_proj.out_sizes[:2])
        self.rotary = rotary  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.sliding_window)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`keep`: the rows to return (all by default); every row's K/V is still written."""
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden, meta.bulk_rows_from).split(self.qkv_proj.out_sizes, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # (both or neither)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, meta)
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim), _bulk_after(meta, keep))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, intermediate_size: int | None = None, reduce: bool = True):
        """`intermediate_size`: the config's by default (another for an MoE model's shared expert).
        `reduce=False`: under tensor parallel, return this rank's partial sum (the caller all-reduces)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter] * 2, False, dtype, parallel="column")
        self.down_proj = Linear(inter, cfg.hidden_size, False, dtype, parallel="row", reduce=reduce)

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x, bulk_rows_from)), bulk_rows_from)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, qk_norm: bool, rotary: RotaryEmbedding, mlp: nn.Module):
        """`mlp`: the layer's MLP, called as mlp(hidden, bulk_rows_from) (the model's `mlp_for` picks it:
        a dense `LlamaMLP`, or a mixture of experts in an MoE family)."""
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, meta, keep=None):
        """`keep`: compute only these rows past attention (the model's last layer, when only they are read)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, _bulk_after(meta, keep)), residual


def _bulk_after(meta: AttentionMetadata | VarlenMetadata, keep: torch.Tensor | None) -> int | None:
    """Where the step's bulk rows start among the rows past attention (`keep`'s, or all of them)."""
    if keep is None:
        return meta.bulk_rows_from
    assert isinstance(meta, AttentionMetadata)  # (only its steps keep rows)
    return meta.bulk_output_rows_from
