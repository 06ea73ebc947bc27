"""BERT-family encoders (`BertModel`): all-MiniLM-L6-v2 and the sentence-transformers models built on BERT.

Absolute position embeddings plus token-type embeddings (every input is one segment: type 0), then
post-layer-norm encoder layers (x = LayerNorm(x + attention(x)); x = LayerNorm(x + MLP(x))) with a GELU
MLP. Attention is bidirectional within each input and keeps no KV cache: a pooling step holds whole inputs
(`VarlenMetadata`). The projections are the shared `Linear` layers (Q, K and V merged into one matmul; GELU
applied by the intermediate one, inside oneDNN's matmul on the CPU), so oneDNN packing and `--quantization`
apply as they do to decoders. Module names follow the checkpoint's,
but for the merged QKV. Neither tensor nor pipeline parallel: an encoder this size does not need them.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine_core.layers.attention import Attention, VarlenMetadata
from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.checkpoint import CheckpointLoading

# config.json's hidden_act -> the Linear activation (engine_core/layers/linear.py ACTIVATIONS) it is
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
_QKV = {"query": 0, "key": 1, "value": 2}


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Table(nn.Module):
    """An embedding table (the checkpoint's `<name>.weight`)."""

    def __init__(self, rows: int, size: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, size, dtype=dtype), requires_grad=False)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, eps: float):
        super().__init__()
        raw = cfg.raw
        self.word_embeddings = Table(cfg.vocab_size, cfg.hidden_size, dtype)
        self.position_embeddings = Table(cfg.max_position_embeddings, cfg.hidden_size, dtype)
        self.token_type_embeddings = Table(raw.get("type_vocab_size", 2), cfg.hidden_size, dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings.weight[input_ids] + self.position_embeddings.weight[positions]
        hidden += self.token_type_embeddings.weight[0]  # one segment per input: token type 0 throughout
        return self.LayerNorm(hidden)


class BertOutput(nn.Module):
    """dense, then LayerNorm(residual + it): both sub-blocks end this way."""

    def __init__(self, in_features: int, hidden: int, eps: float, dtype):
        super().__init__()
        self.dense = Linear(in_features, hidden, True, dtype)
        self.LayerNorm = LayerNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, dtype):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, True, dtype)
        self.attn = Attention(cfg.num_heads, cfg.num_heads, cfg.head_dim, causal=False)
        self.output = BertOutput(hidden, hidden, eps, dtype)

    def forward(self, hidden: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = (x.view(tokens, self.num_heads, self.head_dim) for x in self.qkv_proj(hidden).chunk(3, dim=-1))
        out = self.attn(q, k, v, meta).reshape(tokens, self.num_heads * self.head_dim)
        return self.output(out, hidden)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        activation = cfg.raw.get("hidden_act", "gelu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"BERT activation {activation!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        # (the activation goes with the matmul: fused into it on the CPU)
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, True, dtype, activation=_ACTIVATIONS[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, dtype):
        super().__init__()
        self.attention = BertAttention(cfg, eps, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertOutput(cfg.intermediate_size, cfg.hidden_size, eps, dtype)

    def forward(self, hidden: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, eps, dtype) for _ in range(cfg.num_layers))


class BertModel(CheckpointLoading, nn.Module):
    """Runs only as a pooling model: `forward` gives the last layer's hidden states [tokens, hidden]."""

    encoder_only = True  # bidirectional: whole inputs in one step, never a KV cache

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = True):
        super().__init__()
        if cfg.raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT models with absolute position embeddings are supported")
        eps = float(cfg.raw.get("layer_norm_eps", 1e-12))
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, dtype, eps)
        self.encoder = BertEncoder(cfg, eps, dtype)

    def attention_layers(self) -> list[Attention]:
        return [cast(BertLayer, layer).attention.attn for layer in self.encoder.layer]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: VarlenMetadata, activations=None
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, meta)
        return hidden

    def holds(self, name: str) -> bool:
        return self._target(name) is not None

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        return None  # (no tensor parallel: every tensor is read whole)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter (and merged shard) for a checkpoint name; None for what an encoder's hidden states
        do not use (the pooler's dense layer, the MLM head, the position-id buffer)."""
        name = name.removeprefix("bert.").removeprefix("model.")
        if not name.startswith(("embeddings.", "encoder.")) or name == "embeddings.position_ids":
            return None
        module_path, _, kind = name.rpartition(".")
        kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)  # (old checkpoints' LayerNorm names)
        parent, _, leaf = module_path.rpartition(".")
        if leaf in _QKV and parent.endswith(".attention.self"):
            return f"{parent.removesuffix('.self')}.qkv_proj.{kind}", _QKV[leaf]
        return f"{module_path}.{kind}", None
