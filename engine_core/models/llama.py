"""The Llama family: Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm).

They differ only in switches read from the config: QKV bias, per-head q/k RMSNorm, sliding window. The decoder
layer and its parts are engine_core/models/llama_layers.py; this module assembles the model from them.

Under tensor parallel (engine_core/parallel) each layer names its split and the layers do the rest: QKV
and gate+up are column-parallel (whole heads per rank), the output and down projections row-parallel
(one all-reduce each), the embedding and LM head vocab-parallel (a masked lookup summed over the ranks;
logits gathered on rank 0). Attention then runs on this rank's heads only.

Under pipeline parallel a model holds one stage's layers (the others are `MissingLayer`s, so checkpoint
names keep their indices); the first stage also holds the embedding and the LM head, the last the final
norm (engine_core/parallel/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from pagoda.engine_core.layers.attention import Attention, AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.checkpoint import CheckpointLoading
from pagoda.engine_core.models.fused_decode import FusedDecodeSeat
from pagoda.engine_core.models.llama_layers import LlamaDecoderLayer, LlamaMLP, RMSNorm
from pagoda.engine_core.parallel.distributed import building_group, building_stage
from pagoda.engine_core.parallel.sharding import Span
from pagoda.engine_core.quantization.assembly import LinearAssembler
from pagoda.kernels import ops


def _head_cost_in_layers(cfg: ModelConfig) -> float:
    """The LM head's weights over one decoder layer's: what the first pipeline stage's head costs."""
    q_and_o = 2 * cfg.hidden_size * cfg.num_heads * cfg.head_dim
    k_and_v = 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.vocab_size * cfg.hidden_size / (q_and_o + k_and_v + mlp)


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds."""


# Checkpoint names of the projections we merge -> (our merged module, shard index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        """`pooling`: an embedding model (`--runner pooling`), whose final hidden states are the output;
        it has no LM head unless the head is the (tied) embedding table."""
        super().__init__()
        self.cfg = cfg
        self.tp = building_group()
        self.stage = building_stage()
        self.layer_range = self.stage.layers(cfg.num_layers, head_cost=_head_cost_in_layers(cfg))
        # The LM head is a Linear ([hidden, vocab]); tied models share the embedding's storage through
        # `embed_tokens` = lm_head's transpose (see `load_weights`). Both hold this rank's vocabulary rows,
        # and only the first pipeline stage has them.
        self.lm_head: Linear | None = None
        self.embed_tokens: nn.Parameter | None = None
        if self.stage.is_first:
            self.vocab_span = Span(0, cfg.vocab_size)  # (pooling runs without tensor parallel)
            if not pooling or cfg.tie_word_embeddings:
                self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, parallel="vocab")
                self.vocab_span = self.lm_head.out_spans[0]
            if not cfg.tie_word_embeddings:
                self.embed_tokens = nn.Parameter(
                    torch.empty(self.vocab_span.size, cfg.hidden_size, dtype=dtype), requires_grad=False
                )
        rotary = self.rotary_embedding()
        self.layers = nn.ModuleList(
            self.decoder_layer(i, dtype, rotary) if i in self.layer_range else MissingLayer()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if self.stage.is_last else None
        self.fused_decode = FusedDecodeSeat()  # (CPU decode steps: every layer in one C call)

    def decoder_layer(self, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> nn.Module:
        """Layer `layer_index`: the seat where a family builds its own kind of decoder layer (Gemma's four
        norms and per-layer attention, engine_core/models/gemma.py). `rotary`: the model's shared table."""
        return LlamaDecoderLayer(self.cfg, dtype, self.qk_norm, rotary, self.mlp_for(layer_index, dtype))

    def rotary_embedding(self) -> RotaryEmbedding:
        """The rotary table every layer shares: the seat where a family reads its own rotary settings (Phi-3's
        legacy LongRoPE keys and partial rotary, engine_core/models/phi3.py)."""
        cfg = self.cfg
        return RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, context_len=cfg.max_model_len
        )

    def mlp_for(self, layer_index: int, dtype: torch.dtype) -> nn.Module:
        """Layer `layer_index`'s MLP: the seat where a family declares each layer's MLP kind (the MoE
        families, engine_core/models/moe.py, put a mixture of experts in some or all layers). Dense here."""
        return LlamaMLP(self.cfg, dtype)

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to the whole context), every layer of the model
        and not just this pipeline stage's: the seat where a family declares its layers' attention kinds.
        The KV manager frees a request's blocks that left the window only when every layer slides
        (engine_core/kv_cache.py); the model runner checks that the layers it holds agree with this."""
        return [self.cfg.sliding_window] * self.cfg.num_layers

    def attention_layer_indices(self) -> list[int]:
        """The model's layer index of each of `attention_layers` (every layer of this stage has one here)."""
        return list(self.layer_range)

    def kv_sources(self) -> list[int]:
        """For every model layer, the layer whose K/V cache its attention reads: its own here. A family whose
        later layers reuse an earlier layer's K/V (Gemma 4) names that layer; such a layer keeps no cache."""
        return list(range(self.cfg.num_layers))

    def recurrent_layers(self) -> Sequence[nn.Module]:
        """The layers holding a recurrent state per sequence, bound to the runner's state pools (none here;
        engine_core/models/qwen3_5.py has some)."""
        return []

    def recurrent_state_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Per state slot of each recurrent layer: the shape and dtype of each of its state tensors."""
        return ()

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's layers."""
        # (cast: nn.ModuleList is not generic, its items are typed as any Module)
        return [cast(LlamaDecoderLayer, self.layers[i]) for i in self.layer_range]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.parallel:
            return self._lookup(input_ids)
        # Vocab-parallel: each rank looks up the ids in its rows, zeros for the rest, and the sum over
        # the ranks is the embedding (exactly: one rank contributes each row).
        local = input_ids - self.vocab_span.start
        mine = (local >= 0) & (local < self.vocab_span.size)
        rows = self._lookup(torch.where(mine, local, 0))
        return self.tp.all_reduce(rows.masked_fill_(~mine[:, None], 0.0))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens[input_ids]
        assert self.lm_head is not None  # (tied: the LM head's weight is the table; the first stage embeds)
        packed = self.lm_head.quantized or self.lm_head.panels  # (a tied LM head stored packed: just these rows)
        if packed is not None:
            return ops.embedding_rows(packed, input_ids, self.lm_head.weight.dtype)
        return self.lm_head.weight[input_ids]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        activations: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final (normed) hidden states [tokens, hidden]. On a pipeline stage: the first embeds
        `input_ids`, the others continue from `activations` (the previous stage's output), and every
        stage but the last returns its activations [2, tokens, hidden] (hidden states, residual)."""
        if activations is None:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = activations[0], activations[1]
        fused = self.fused_decode.decoder_for(self, meta, hidden)
        keep = None
        if fused is not None:  # (a CPU decode step: every layer in one C call)
            assert isinstance(meta, AttentionMetadata)
            hidden, residual = fused(
                positions,
                hidden,
                residual,
                meta.slot_mapping[0],  # (one KV group: its layers' windows are all the same)
                meta.block_tables[0],
                meta.seq_lens,
                meta.max_decode_seq_len,
            )
        else:
            # A step with prompt rows reads the final hidden states of a few rows only (the LM head's,
            # prompt logprobs'): past the last layer's attention, which writes every row's K/V, the other
            # rows feed nothing, so its output projection and MLP take just those (as llama.cpp does).
            if isinstance(meta, AttentionMetadata) and self.stage.is_last:
                keep = meta.output_rows
            for i in self.layer_range:
                last = i == self.layer_range[-1]
                hidden, residual = self.layers[i](positions, hidden, residual, meta, keep if last else None)
        assert residual is not None  # (every stage holds a layer)
        if self.norm is None:
            return torch.stack((hidden, residual))
        hidden, _ = self.norm(hidden, residual)
        if keep is None:
            return hidden
        full = hidden.new_empty(positions.shape[0], hidden.shape[1])  # (the other rows: never read)
        full[keep] = hidden
        return full

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] on rank 0 (gathered from every rank's vocabulary slice); None on
        the other ranks, which must still call it with the same rows (the gather is collective). The
        first pipeline stage's ranks only."""
        assert self.lm_head is not None
        logits = self.lm_head(hidden).float()
        return self.tp.gather_last_dim(logits, self.cfg.vocab_size)

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` has a place in this stage's part of the model."""
        return self._target(name) is not None

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        """The slice of checkpoint tensor `name` this rank loads; None: all of it (always, without tensor
        parallel). `assembled`: a quantization assembler takes the linears' tensors (but biases) whole and
        slices them after conversion (quantization/assembly.py)."""
        if not self.tp.parallel:
            return None
        target = self._target(name)
        if target is None:
            return None
        param_name, shard = target
        if param_name == "embed_tokens":
            return (self.vocab_span.slice(),)
        module_path, _, kind = param_name.rpartition(".")
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None
        if not isinstance(module, Linear) or (assembled and LinearAssembler.accepts(kind)):
            return None
        return module.checkpoint_slices(shard, kind)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter (and merged shard index) for a checkpoint tensor name; None to skip it."""
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.")
        module_path, _, kind = name.rpartition(".")  # kind: weight | bias | a quantized format's tensor
        if not self._on_this_stage(module_path):
            return None
        if module_path == "embed_tokens":  # tied: the LM head's weight is the table
            if self.embed_tokens is None:
                return f"lm_head.{kind}", None
            return ("embed_tokens", None) if kind == "weight" else (name, None)
        if module_path == "lm_head" and (self.embed_tokens is None or self.lm_head is None):
            return None  # tied (the table is the head), or pooling (no head)
        parent_path, _, leaf = module_path.rpartition(".")
        if leaf in _MERGED:
            merged_name, shard = _MERGED[leaf]
            return f"{parent_path}.{merged_name}.{kind}", shard
        return name, None

    def _on_this_stage(self, module_path: str) -> bool:
        first = module_path.split(".", 2)
        if first[0] == "layers" and len(first) > 1 and first[1].isdigit():
            return int(first[1]) in self.layer_range
        if module_path in ("embed_tokens", "lm_head"):
            return self.stage.is_first
        if module_path == "norm":
            return self.stage.is_last
        return True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
