"""Qwen3.5: `Qwen3_5ForCausalLM` (dense), `Qwen3_5MoeForCausalLM` (mixture of experts) and the text model of
their vision-language checkpoints (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`),
as Hugging Face's modeling_qwen3_5.py / modeling_qwen3_5_moe.py (transformers 5.25) compute them.

A hybrid model: each layer's mixer is what the config's `layer_types` says (by default three
"linear_attention" layers, then a "full_attention" one: `full_attention_interval` 4):

- linear attention, Gated DeltaNet (`GatedDeltaNet`): one projection of the input into q/k/v (through a causal
  depthwise conv1d and SiLU), z (the output gate), b (beta) and a (the decay); the gated delta rule over a
  fixed-size recurrent state per sequence; an RMSNorm of each value head gated by silu(z) (plain weight w);
  the output projection. Its per-sequence state is two tensors the model runner binds to the layer from its
  state pool, as it binds a KV cache to an `Attention`: `conv_states` [slots, K - 1, conv channels] (model
  dtype) and `recurrent_states` [slots, Hv, Dk, Dv] (float32); the step's `AttentionMetadata` says each
  sequence's slot (`state_slots`) and which slots start fresh (`fresh_states`, zeroed by the layer).
- full attention (`GatedAttention`): the shared paged `Attention`, with q_proj producing each head's query
  and an output gate side by side ([q_h | gate_h] per head); per-head q/k RMSNorm; a partial rotary
  embedding (the first `partial_rotary_factor` of each head's dims, neox style); the attention output
  multiplied by sigmoid(gate) before o_proj. The config's mrope sections (`mrope_section`) split the rotary
  dims between text, height and width positions; for text the three positions are the same 1-D position,
  so it is the plain rotary embedding.

RMSNorms (the layers', the final one, q/k norms) scale by (1 + w), as Gemma's (`GemmaRMSNorm`: 1 + w stored
in float32 at load); the linear attention's gated norm scales by w. The MLP is SwiGLU (dense), or in the MoE
variant every layer a mixture of experts with top-k weights renormalized and a shared expert scaled by
sigmoid(shared_expert_gate(x)) (`MoEMLP`, engine_core/models/moe.py). Checkpoints store experts apart
(`experts.E.gate_proj`, what transformers writes) or stacked (`experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I], transformers' in-memory names): both load. Vision-language checkpoints hold the
text model under `model.language_model.`; the vision tower (`model.visual.`) and the multi-token-prediction
head (`mtp.`) are skipped.

Tensor parallel: each rank holds whole heads. The gated attention splits as Llama's does (a query head's rows
hold its output gate too); a Gated DeltaNet layer holds a contiguous share of its key heads and of its value
heads (which follow the key heads, `linear_num_value_heads` / `linear_num_key_heads` per key head), so its
recurrent state is per rank too, and its output projection is row-parallel. The checkpoint's `in_proj_qkv`
and `conv1d` stack all query heads, then all key heads, then all value heads: at load their rows are put in
rank-major order (each rank's query, key and value heads together), so that each rank's share is one
contiguous run (`_rank_major`); the others split as ordinary column-parallel rows. That needs float weights
(or quantization at load): a quantized checkpoint's `in_proj_qkv` under tensor parallel is refused.

Pipeline parallel: each stage holds its layers' states (a stage of linear-attention layers alone keeps no KV
pool). Not supported (refused at build): activations other than SiLU. The fused CPU decode step is off (it
runs Llama's layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from pagoda.engine_core.gguf_gemma import NORMS_INCLUDE_ONE
from pagoda.engine_core.layers.attention import Attention, AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.gemma import GemmaRMSNorm
from pagoda.engine_core.models.llama import LlamaForCausalLM
from pagoda.engine_core.models.llama_layers import _bulk_after
from pagoda.engine_core.models.moe import MoEForCausalLM, MoEMLP, stacked_expert_pieces
from pagoda.engine_core.parallel.distributed import building_group
from pagoda.engine_core.parallel.sharding import AttentionHeads
from pagoda.engine_core.quantization.assembly import LinearAssembler
from pagoda.kernels import ops

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# The linear attention's input projections, merged into one `in_proj` (one matmul): name -> shard index.
_IN_PROJ = {"in_proj_qkv": 0, "in_proj_z": 1, "in_proj_b": 2, "in_proj_a": 3}
# Norms that scale by (1 + w): the layers', the final one and the q/k norms (not linear_attn.norm's w).
_ONE_PLUS_W_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight")


class StateSlots:
    """One step's sequences as the recurrent ops take them: where each one's new tokens start
    (`cu_seqlens` [B + 1] int64) and the pool slot holding its state (`slots` [B] int64)."""

    def __init__(self, cu_seqlens: torch.Tensor, slots: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self.slots = slots

    @classmethod
    def of_step(cls, meta: AttentionMetadata) -> StateSlots:
        """The decodes are the step's first `num_decodes` tokens, one each; then the prefill sequences, whose
        token ranges `query_start_loc` gives relative to them; `state_slots` names each one's slot in that
        order (the order of `seq_lens`)."""
        slots = getattr(meta, "state_slots", None)
        if slots is None:
            raise RuntimeError("a step of a model with recurrent layers needs AttentionMetadata.state_slots")
        decodes = meta.num_decodes
        device = meta.query_start_loc.device
        decode_starts = torch.arange(decodes + 1, device=device, dtype=torch.int64)
        prefill_ends = meta.query_start_loc[1:].to(torch.int64) + decodes
        return cls(torch.cat((decode_starts, prefill_ends)), slots)


class DepthwiseConvWeight(nn.Module):
    """The causal conv1d's weight as checkpoints store it (`conv1d.weight` [C, 1, K], no bias)."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=dtype), requires_grad=False)


class GatedRMSNorm(nn.Module):
    """HF's Qwen3_5RMSNormGated: rms-normalize each value head, scale by w (plain), multiply by silu(gate)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_gated(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (HF's Qwen3_5GatedDeltaNet) over per-sequence states in the runner's pool.

    The runner binds `conv_states` [num_state_slots, K - 1, conv_dim] (the model's dtype) and
    `recurrent_states` [num_state_slots, Hv, Dk, Dv] (float32) before the first step (None until then), as
    `recurrent_state_shapes` of the model says. The ops read and update the slots the step names in place."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        raw = cfg.raw
        self.tp = building_group()
        k_heads, v_heads = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
        world = self.tp.world_size
        if k_heads % world or v_heads % world:
            raise ValueError(
                f"{cfg.architecture}: tensor_parallel_size {world} must divide the linear attention's {k_heads} "
                f"key heads and {v_heads} value heads"
            )
        self.num_k_heads, self.num_v_heads = k_heads // world, v_heads // world  # (this rank's)
        self.head_k_dim, self.head_v_dim = int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"])
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = int(raw.get("linear_conv_kernel_dim") or 4)
        key_all, value_all = k_heads * self.head_k_dim, v_heads * self.head_v_dim  # (every rank's)
        self.in_proj = MergedLinear(
            cfg.hidden_size, [2 * key_all + value_all, value_all, v_heads, v_heads], False, dtype, parallel="column"
        )
        self.conv1d = DepthwiseConvWeight(self.conv_dim, self.conv_width, dtype)
        heads = self.num_v_heads
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = Linear(value_all, cfg.hidden_size, False, dtype, parallel="row")
        self.conv_states: torch.Tensor | None = None  # bound by the model runner
        self.recurrent_states: torch.Tensor | None = None

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Each of the two per-slot states' (shape, dtype): the conv window, then the recurrent state."""
        conv = ((self.conv_width - 1, self.conv_dim), dtype)
        recurrent = ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)
        return conv, recurrent

    def reads_host(self, device: torch.device) -> bool:
        """Whether the ops read values on the host on `device`, so that no CUDA graph can capture the layer
        (engine_core/cuda_graphs.py): the torch references of the conv1d and the delta rule do (they loop over
        the sequences). Zeroing fresh slots does too, so a captured step must carry `fresh_states` None."""
        return not (ops.graph_safe("causal_conv1d", device) and ops.graph_safe("gated_delta_rule", device))

    def forward(
        self,
        hidden: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`keep`: the rows to return (all by default); every sequence's state still takes every row."""
        tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj(hidden, meta.bulk_rows_from).split(self.in_proj.out_sizes, dim=-1)
        conv_states, states, batch = self._states(meta, hidden)
        weight = self.conv1d.weight[:, 0]  # [C, K]
        qkv = ops.causal_conv1d(mixed, weight, None, conv_states, batch.cu_seqlens, batch.slots, "silu")
        key_size = self.key_dim
        query = qkv[:, :key_size].view(tokens, self.num_k_heads, self.head_k_dim)
        key = qkv[:, key_size : 2 * key_size].view(tokens, self.num_k_heads, self.head_k_dim)
        value = qkv[:, 2 * key_size :].view(tokens, self.num_v_heads, self.head_v_dim)
        g, beta = ops.gdn_gating(a, b, self.A_log, self.dt_bias)
        out = ops.gated_delta_rule(query, key, value, g, beta, states, batch.cu_seqlens, batch.slots)
        out = self.norm(out, z.view(tokens, self.num_v_heads, self.head_v_dim))
        if keep is not None:
            out = out[keep]
        return self.out_proj(out.reshape(out.shape[0], self.value_dim), _bulk_after(meta, keep))

    def _states(
        self, meta: AttentionMetadata | VarlenMetadata, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, StateSlots]:
        """The state pools and the step's sequences in them. A pooling step (whole sequences, no cache)
        runs each sequence from zero states of its own; a generation step uses the bound pools, its
        fresh sequences' slots zeroed first (a slot handed out again holds its last owner's state)."""
        if isinstance(meta, VarlenMetadata):
            count = meta.query_start_loc.shape[0] - 1
            (conv_shape, conv_dtype), (state_shape, state_dtype) = self.state_shapes(hidden.dtype)
            conv_states = hidden.new_zeros((count, *conv_shape), dtype=conv_dtype)
            states = hidden.new_zeros((count, *state_shape), dtype=state_dtype)
            slots = torch.arange(count, device=hidden.device)
            return conv_states, states, StateSlots(meta.query_start_loc.to(torch.int64), slots)
        if self.conv_states is None or self.recurrent_states is None:
            raise RuntimeError("the model runner has not bound this linear-attention layer's state pools")
        batch = StateSlots.of_step(meta)
        fresh = getattr(meta, "fresh_states", None)
        if fresh is not None:
            fresh_slots = batch.slots[fresh]  # (reads the mask on the host: pass None in steps with none fresh)
            self.conv_states.index_fill_(0, fresh_slots, 0.0)
            self.recurrent_states.index_fill_(0, fresh_slots, 0.0)
        return self.conv_states, self.recurrent_states, batch


class GatedAttention(nn.Module):
    """HF's Qwen3_5Attention: q_proj makes each head's query and output gate side by side; q/k RMSNorm
    (1 + w) per head; partial rotary embedding; the paged `Attention`; output * sigmoid(gate); o_proj."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        heads = AttentionHeads(cfg.num_heads, cfg.num_kv_heads)
        # (merged as Llama's: q_proj, k_proj, v_proj load as its shards 0, 1, 2; the query part is twice q_size)
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, [2 * q_size, kv_size, kv_size], cfg.attention_bias, dtype, parallel="column", heads=heads
        )
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.attention_bias, dtype, parallel="row", heads=heads)
        # This rank's heads (all of them without tensor parallel).
        self.num_heads = self.qkv_proj.out_sizes[0] // (2 * self.head_dim)
        self.num_kv_heads = self.qkv_proj.out_sizes[1] // self.head_dim
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate, k, v = self.qkv_proj(hidden, meta.bulk_rows_from).split(self.qkv_proj.out_sizes, dim=-1)
        query_gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., : self.head_dim], query_gate[..., self.head_dim :]
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, meta)
        if keep is not None:
            out, gate = out[keep], gate[keep]
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim), _bulk_after(meta, keep))


class Qwen3_5DecoderLayer(nn.Module):
    """Norm, mixer (linear or full attention), residual; norm, MLP, residual (HF's Qwen3_5DecoderLayer), the
    additions deferred to the next norm as Llama's layer defers them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kind: str, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.kind = kind
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        else:
            self.self_attn = GatedAttention(cfg, dtype, rotary)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta, keep=None):
        """`keep`: compute only these rows past the mixer (the model's last layer, when only they are read)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.linear_attn is not None:
            hidden = self.linear_attn(hidden, meta, keep)
        else:
            assert self.self_attn is not None
            hidden = self.self_attn(positions, hidden, meta, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, _bulk_after(meta, keep)), residual


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's mixer: the config's `layer_types`, else HF's default (a full-attention layer every
    `full_attention_interval` layers, 4 by default, the others linear attention)."""
    if cfg.layer_types:
        if len(cfg.layer_types) != cfg.num_layers:
            raise ValueError(
                f"{cfg.architecture}: layer_types names {len(cfg.layer_types)} layers, the model has {cfg.num_layers}"
            )
        unknown = set(cfg.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"{cfg.architecture}: unknown layer types {sorted(unknown)}")
        return cfg.layer_types
    interval = int(cfg.raw.get("full_attention_interval") or 4)
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(cfg.num_layers))


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        name = cfg.architecture
        activation = cfg.raw.get("hidden_act") or "silu"
        if activation != "silu":
            raise ValueError(f"{name}: hidden activation {activation!r} is not supported (silu)")
        self.kinds = layer_kinds(cfg)
        self.dtype = dtype
        self.partial_rotary: RotaryEmbedding | None = None  # (built with the first full-attention layer)
        super().__init__(cfg, dtype, pooling)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode.enabled = False  # (the C decoder runs the Llama layer)

    def decoder_layer(self, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> nn.Module:
        kind = self.kinds[layer_index]
        return Qwen3_5DecoderLayer(self.cfg, dtype, kind, self._rotary(), self.mlp_for(layer_index, dtype))

    def _rotary(self) -> RotaryEmbedding:
        """The full-attention layers' table over the first `partial_rotary_factor` of each head's dims (HF
        computes its frequencies over those dims alone). mrope sections: see the module's docstring."""
        if self.partial_rotary is None:
            cfg = self.cfg
            scaling = dict(cfg.rope_scaling or {})
            factor = float(scaling.pop("partial_rotary_factor", None) or cfg.raw.get("partial_rotary_factor") or 0.25)
            for text_only in ("mrope_section", "mrope_interleaved"):
                scaling.pop(text_only, None)
            rotary_dim = int(cfg.head_dim * factor)
            table = RotaryEmbedding(rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, scaling or None)
            self.partial_rotary = table
        return self.partial_rotary

    def layer_types(self) -> tuple[str, ...]:
        """Each layer's mixer kind, every layer of the model: "linear_attention" (a recurrent state per
        sequence, `recurrent_layers`) or "full_attention" (paged KV, `attention_layers`)."""
        return self.kinds

    def attention_windows(self) -> list[int | None]:
        return [None] * self.cfg.num_layers  # (no sliding window: the full layers see the whole context)

    def attention_layers(self) -> list[Attention]:
        """The full-attention layers' `Attention`s, in layer order (fewer than the layers)."""
        return [layer.self_attn.attn for layer in self._layers() if layer.self_attn is not None]

    def attention_layer_indices(self) -> list[int]:
        """The model's layer index of each of `attention_layers`."""
        return [i for i in self.layer_range if self.kinds[i] == FULL_ATTENTION]

    def recurrent_layers(self) -> list[GatedDeltaNet]:
        """The linear-attention layers, in layer order: the runner binds each its `conv_states` and
        `recurrent_states` pools (shapes: `recurrent_state_shapes`)."""
        return [layer.linear_attn for layer in self._layers() if layer.linear_attn is not None]

    def recurrent_state_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Per state slot, per linear-attention layer: ((K - 1, conv_dim), model dtype) for `conv_states`,
        ((Hv, Dk, Dv), float32) for `recurrent_states`. Every linear-attention layer has the same."""
        layers = self.recurrent_layers()
        if not layers:
            return ()
        return layers[0].state_shapes(self.dtype)

    def _layers(self) -> list[Qwen3_5DecoderLayer]:
        return [cast(Qwen3_5DecoderLayer, self.layers[i]) for i in self.layer_range]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        super().load_weights(self._in_our_layout(weights, assembled=assembler is not None), assembler)

    def _in_our_layout(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembled: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Text-model names; norm weights that scale by (1 + w) as 1 + w in float32 (`GemmaRMSNorm`); stacked
        experts as each expert's projections (views); under tensor parallel the linear attention's tensors
        that `checkpoint_slices` reads whole cut to this rank's heads (`_rank_major`). A GGUF file's norms
        hold 1 + w already (config.json's NORMS_INCLUDE_ONE, engine_core/gguf_qwen35.py): they load as
        stored."""
        include_one = bool(self.cfg.raw.get(NORMS_INCLUDE_ONE))
        for checkpoint_name, tensor in weights:
            name = _text_name(checkpoint_name)
            if name is None:
                continue
            if name.endswith(_ONE_PLUS_W_NORMS) or name == "model.norm.weight":
                tensor = tensor.float() if include_one else tensor.float() + 1.0
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                layer = int(name.removeprefix("model.layers.").split(".", 1)[0])
                mlp = cast(MoEMLP, self.layers[layer].mlp)
                yield from stacked_expert_pieces(name, tensor, mlp, cut=not assembled)
                continue
            if self.tp.parallel and name.endswith(_PER_HEAD):
                tensor = self._rank_share(name, tensor, assembled)
            yield name, tensor

    def _rank_share(self, name: str, tensor: torch.Tensor, assembled: bool) -> torch.Tensor:
        """Under tensor parallel, a linear-attention tensor read whole: `in_proj_qkv` and `conv1d` rows in
        rank-major order, then (but for a quantization assembler's linear, which cuts after converting) this
        rank's run of them; A_log's and dt_bias's entries of this rank's value heads."""
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            raw = self.cfg.raw
            key_all = int(raw["linear_num_key_heads"]) * int(raw["linear_key_head_dim"])
            value_all = int(raw["linear_num_value_heads"]) * int(raw["linear_value_head_dim"])
            tensor = _rank_major(tensor, [key_all, key_all, value_all], self.tp.world_size)
            if assembled and name.endswith("in_proj_qkv.weight"):
                return tensor
        elif not name.endswith(("A_log", "dt_bias")):
            kind = name.rpartition(".")[2]
            raise ValueError(
                f"{self.cfg.architecture}: tensor parallel needs the linear attention's in_proj_qkv in float "
                f"(this checkpoint stores it as {kind!r}): use one rank, or a float checkpoint"
            )
        share = tensor.shape[0] // self.tp.world_size
        return tensor[self.tp.rank * share : (self.tp.rank + 1) * share]

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        text_name = _text_name(name)
        if text_name is not None and text_name.endswith(_PER_HEAD):
            return None  # (read whole: `_rank_share` cuts them)
        return super().checkpoint_slices(name, assembled)

    def holds(self, name: str) -> bool:
        text_name = _text_name(name)
        return text_name is not None and super().holds(text_name)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        text_name = _text_name(name)
        if text_name is None:
            return None
        module_path, _, kind = text_name.removeprefix("model.").rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in _IN_PROJ:
            if not self._on_this_stage(parent):
                return None
            return f"{parent}.in_proj.{kind}", _IN_PROJ[leaf]
        return super()._target(text_name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, MoEForCausalLM):
    """Every layer's MLP a mixture of experts with a shared expert (`MoEMLP`); the router's top-k weights
    renormalized (HF's Qwen3_5MoeTopKRouter, engine_core/model_config.py sets norm_topk_prob)."""


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5 vision-language checkpoint (its config's `text_config`; images are not
    supported)."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The text model of a Qwen3.5-MoE vision-language checkpoint (images are not supported)."""


# The linear attention's tensors whose rank shares `checkpoint_slices` cannot name as one slice of the
# checkpoint's tensor (`in_proj_qkv`'s and `conv1d`'s: three runs of rows), or that are no linear's (A_log,
# dt_bias): read whole, cut at load. in_proj_qkv's other kinds (a quantized checkpoint's) are refused there.
_PER_HEAD = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.conv1d.weight",
    "linear_attn.A_log",
    "linear_attn.dt_bias",
    "linear_attn.in_proj_qkv.qweight",
    "linear_attn.in_proj_qkv.weight_packed",
    "linear_attn.in_proj_qkv.gguf_blocks",
)


def _rank_major(tensor: torch.Tensor, parts: list[int], world: int) -> torch.Tensor:
    """Rows in `parts` runs (query, key, value heads), each split evenly over `world` ranks, reordered so that
    each rank's pieces of every run are adjacent: [q0 k0 v0 q1 k1 v1 ...]."""
    pieces = [run.chunk(world) for run in tensor.split(parts)]
    return torch.cat([piece for rank in range(world) for piece in (run[rank] for run in pieces)])


def _text_name(name: str) -> str | None:
    """A checkpoint tensor's name as a Qwen3_5ForCausalLM checkpoint names it; None for the vision tower's
    and the multi-token-prediction head's."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith(("model.visual.", "mtp.")):
        return None
    return name
