"""Google's Gemma 4, text (`Gemma4ForCausalLM`, and the text model of `Gemma4ForConditionalGeneration`
checkpoints), as Hugging Face's modeling_gemma4.py computes it:

- Gemma's embedding scale and final logit soft-capping (`GemmaEmbeddingAndHead`), GeGLU MLPs (`GemmaMLP`),
  four norms per layer around the attention and the MLP; unlike Gemma 2/3 its RMSNorms scale by w, not 1 + w;
- sliding-window and full layers as `layer_types` says (HF's default: five sliding to one full, the last
  layer full). The full layers have their own K/V heads and head size (`per_layer_config`, or transformers'
  `global_head_dim` / `num_global_key_value_heads`), so the KV pool keeps a group per shape
  (engine_core/kv_groups.py); the sliding layers rotate with the default rope, the full ones with their own
  (Gemma 4's "proportional": a quarter of the head's frequencies, the rest unrotated);
- attention: per-head RMSNorm of q and k (with weights) and of v (without), no scaling of the scores
  (the norms set their size); `attention_k_eq_v`: the full layers' values are their keys' projection
  (normed as values, unrotated);
- KV sharing: the last `num_kv_shared_layers` layers compute queries only, and attend over the K/V of the
  last earlier layer of their kind (`kv_sources`): they keep no cache of their own, and get that layer's
  K/V of the step from it. With `use_double_wide_mlp` their MLPs are twice as wide;
- per-layer input embeddings (PLE): a second table gives every token a small vector per layer, added to a
  projection of the token's embedding; after its MLP each layer gates that vector with its hidden state and
  adds it back, projected, to the residual stream; then each layer's output is scaled by its `layer_scalar`;
- the MoE block (`enable_moe_block`, Gemma 4 26B-A4B): beside each layer's dense MLP a mixture of experts
  (`Gemma4MoE`, on the shared `MoEMLP` and `ops.fused_moe`) whose router norms its input on its own and
  scales each chosen expert's weight (`per_expert_scale`), whose experts compute GeGLU; the two outputs are
  normed apart and added. Checkpoints stack the experts (`experts.gate_up_proj` [E, 2I, H], `down_proj`):
  they load as each expert's projections (`stacked_expert_pieces`), so quantization at load and expert
  parallel work as for the other MoE families.

Tensor parallel splits the attention heads, the MLPs and the experts as for Gemma 3 and the MoE families;
the per-layer-input linears and table are replicated. Refused at build: pipeline parallel (the per-layer
inputs come from the first stage's tokens, and the KV-shared layers read earlier layers' caches) and
bidirectional attention.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine_core.layers.attention import Attention, AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.gemma import (
    GemmaEmbeddingAndHead,
    GemmaMLP,
    VisionCheckpointText,
    check_gelu_tanh,
    layer_kinds,
)
from pagoda.engine_core.models.llama_layers import RMSNorm, _bulk_after
from pagoda.engine_core.models.moe import EXPERT_PROJECTIONS, MoEMLP, stacked_expert_pieces
from pagoda.engine_core.parallel.distributed import building_group
from pagoda.engine_core.parallel.sharding import AttentionHeads
from pagoda.engine_core.quantization.assembly import LinearAssembler
from pagoda.kernels import ops
from pagoda.kernels.torch_ref.moe import GeGLU

SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer kind -> the keys and values of this step


@dataclass(frozen=True)
class LayerSpec:
    kind: str  # "sliding_attention" | "full_attention"
    kv_heads: int  # the checkpoint's (all ranks')
    head_dim: int
    source: int  # the layer whose K/V it attends over (itself, unless KV-shared)
    stores: bool  # a later layer reads this layer's K/V
    values_are_keys: bool  # attention_k_eq_v on a full layer: no v_proj
    intermediate_size: int


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Every layer's attention kind, K/V shape, K/V source and MLP width, from the config as transformers'
    Gemma4TextConfig reads it."""
    raw = cfg.raw
    kinds = list(layer_kinds(cfg, 6))
    kinds[-1] = "full_attention"  # (HF forces the last layer full)
    overrides = {int(index): layer for index, layer in (raw.get("per_layer_config") or {}).items()}
    if "per_layer_config" not in raw:  # (transformers' reading of a config written without it)
        full = {"head_dim": int(raw.get("global_head_dim") or 512)}
        if raw.get("attention_k_eq_v", True) and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        overrides = {i: full for i, kind in enumerate(kinds) if kind == "full_attention"}
    shared = int(raw.get("num_kv_shared_layers") or 0)
    first_shared = cfg.num_layers - shared
    if shared and first_shared <= 0:
        raise ValueError(f"{cfg.architecture}: num_kv_shared_layers {shared} leaves no layer computing K/V")
    sources = list(range(cfg.num_layers))
    for i in range(first_shared, cfg.num_layers):
        producers = [j for j in range(first_shared) if kinds[j] == kinds[i]]
        if not producers:
            raise ValueError(f"{cfg.architecture}: KV-shared layer {i} ({kinds[i]}) has no earlier layer of its kind")
        sources[i] = producers[-1]
    double_wide = bool(raw.get("use_double_wide_mlp"))
    specs = []
    for i, kind in enumerate(kinds):
        layer = overrides.get(i, {})
        specs.append(
            LayerSpec(
                kind=kind,
                kv_heads=int(layer.get("num_key_value_heads") or cfg.num_kv_heads),
                head_dim=int(layer.get("head_dim") or cfg.head_dim),
                source=sources[i],
                stores=i in sources[first_shared:],
                values_are_keys=bool(raw.get("attention_k_eq_v")) and kind == "full_attention",
                intermediate_size=cfg.intermediate_size * (2 if double_wide and sources[i] != i else 1),
            )
        )
    return specs


class Gemma4Attention(nn.Module):
    """q/k/v RMSNorms, unscaled scores, this layer's heads and rotary table; a KV-shared layer projects
    queries only and attends over its source layer's K/V (`shared`, this step's)."""

    unit: torch.Tensor  # (a buffer: v's norm has no weight)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, spec: LayerSpec, index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.spec, self.reads_shared = spec, spec.source != index
        self.head_dim = spec.head_dim
        q_size, kv_size = cfg.num_heads * spec.head_dim, spec.kv_heads * spec.head_dim
        heads = AttentionHeads(cfg.num_heads, spec.kv_heads)
        sizes = (
            [q_size] if self.reads_shared else [q_size, kv_size] if spec.values_are_keys else [q_size] + [kv_size] * 2
        )
        self.qkv_proj = MergedLinear(cfg.hidden_size, sizes, cfg.attention_bias, dtype, parallel="column", heads=heads)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.attention_bias, dtype, parallel="row", heads=heads)
        tp = building_group()
        self.num_heads = self.qkv_proj.out_sizes[0] // spec.head_dim  # this rank's
        self.num_kv_heads = heads.of_rank(tp.rank, tp.world_size)[1].size if tp.parallel else spec.kv_heads
        self.rotary = rotary
        window = cfg.sliding_window if spec.kind == "sliding_attention" else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, spec.head_dim, window)
        self.attn.scale = 1.0
        self.eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(spec.head_dim, cfg.rms_norm_eps, dtype)
        if not self.reads_shared:
            self.k_norm = RMSNorm(spec.head_dim, cfg.rms_norm_eps, dtype)
            self.register_buffer("unit", torch.ones(spec.head_dim, dtype=dtype), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        shared: SharedKV,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`shared`: the K/V of this step that KV-shared layers read, by kind (filled by the layers they read);
        `keep`: the rows to return (all by default)."""
        tokens = hidden.shape[0]
        parts = self.qkv_proj(hidden, meta.bulk_rows_from).split(self.qkv_proj.out_sizes, dim=-1)
        q = self.q_norm(parts[0].reshape(tokens, self.num_heads, self.head_dim))
        if self.reads_shared:
            k, v = shared[self.spec.kind]
            q, _ = self.rotary(positions, q, q.new_empty(tokens, 0, self.head_dim))
        else:
            k = parts[1].reshape(tokens, self.num_kv_heads, self.head_dim)
            v = parts[2].reshape(k.shape) if len(parts) == 3 else k  # (attention_k_eq_v: the keys' projection)
            v = ops.rms_norm(v, self.unit, self.eps)
            q, k = self.rotary(positions, q, self.k_norm(k))
            if self.spec.stores:
                shared[self.spec.kind] = (k, v)
        out = self.attn(q, k, v, meta)
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim), _bulk_after(meta, keep))


class _RouterScales(nn.Module):
    """The router's scales (a module of their own: an `MoEMLP`'s own parameters are its stacked experts)."""

    def __init__(self, hidden: int, experts: int, dtype: torch.dtype):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=dtype), requires_grad=False)


class Gemma4MoE(MoEMLP):
    """The MoE block of a layer (HF's Gemma4TextRouter and Gemma4TextExperts): the router reads the residual
    stream, RMS-normed without a weight, times `router.scale` and hidden_size^-0.5; softmax over every
    expert, top-k, renormalized, each weight times its expert's `router.per_expert_scale`; the experts
    compute GeGLU on the layer's other normed input. The checkpoint's `router.proj` is our `gate`."""

    unit: torch.Tensor  # (a buffer: the router's norm has no weight)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__(cfg, dtype, weights_in_hidden_dtype=False)  # (HF scales in float32, then rounds)
        self.router = _RouterScales(cfg.hidden_size, cfg.num_experts, dtype)
        self.register_buffer("unit", torch.ones(cfg.hidden_size, dtype=dtype), persistent=False)
        self.eps, self.root = cfg.rms_norm_eps, cfg.hidden_size**-0.5

    def forward(self, x: torch.Tensor, experts_input: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """The experts' sum for `experts_input`, routed by `x` (the residual stream); this rank's part summed
        over the ranks."""
        assert experts_input is not None
        logits = self.gate(ops.rms_norm(x, self.unit, self.eps) * self.router.scale * self.root).float()
        routing = replace(self.routing, expert_scales=self.router.per_expert_scale)
        w13, w2 = self.experts()
        return self.tp.all_reduce(ops.fused_moe(experts_input, logits, w13, w2, routing, activation=GeGLU()))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, spec: LayerSpec, index: int, rotary: RotaryEmbedding):
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, dtype, spec, index, rotary)
        self.mlp = GemmaMLP(cfg, dtype, spec.intermediate_size)
        self.moe: Gemma4MoE | None = None
        if cfg.is_moe:
            self.moe = Gemma4MoE(cfg, dtype)
            self.post_feedforward_layernorm_1 = RMSNorm(size, eps, dtype)
            self.pre_feedforward_layernorm_2 = RMSNorm(size, eps, dtype)
            self.post_feedforward_layernorm_2 = RMSNorm(size, eps, dtype)
        self.input_layernorm = RMSNorm(size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        per_layer = int(cfg.raw.get("hidden_size_per_layer_input") or 0)
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if per_layer:
            self.per_layer_input_gate = Linear(size, per_layer, False, dtype)
            self.per_layer_projection = Linear(per_layer, size, False, dtype)
            self.post_per_layer_input_norm = RMSNorm(size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        per_layer_input: torch.Tensor | None,
        shared: SharedKV,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HF's Gemma4TextDecoderLayer: r = x + post_attention_norm(attn(input_norm(x))); then
        h = r + post_ff_norm(mlp(pre_ff_norm(r))), where the MoE block makes that mlp(...)
        post_ff_norm_1(mlp(pre_ff_norm(r))) + post_ff_norm_2(moe(r, pre_ff_norm_2(r))); with per-layer inputs
        h += norm(proj(gelu(gate(h)) * input)); the output is h * layer_scalar. `keep`: as Llama's layer's."""
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden), meta, shared, keep)
        if keep is not None:
            residual = residual[keep]
            per_layer_input = per_layer_input[keep] if per_layer_input is not None else None
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        hidden = self.mlp(hidden, _bulk_after(meta, keep))
        if self.moe is not None:
            experts = self.moe(residual, self.pre_feedforward_layernorm_2(residual))
            hidden = self.post_feedforward_layernorm_1(hidden) + self.post_feedforward_layernorm_2(experts)
        hidden = residual + self.post_feedforward_layernorm(hidden)
        if per_layer_input is not None:
            assert self.per_layer_input_gate is not None and self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class _Table(nn.Module):
    """An embedding table as a checkpoint names it (`<name>.weight`)."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, width, dtype=dtype), requires_grad=False)


class Gemma4ForCausalLM(GemmaEmbeddingAndHead):
    ple_scale: torch.Tensor  # (a buffer: sqrt(hidden_size_per_layer_input) in the weights' dtype)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        check_gelu_tanh(cfg)
        if cfg.raw.get("use_bidirectional_attention") == "all":
            raise ValueError(f"{cfg.architecture}: bidirectional attention (an embedding Gemma) is not supported")
        self.specs = layer_specs(cfg)
        self.rotaries: dict[str, RotaryEmbedding] = {}
        super().__init__(cfg, dtype, pooling)
        if not (self.stage.is_first and self.stage.is_last):
            raise ValueError(
                f"{cfg.architecture}: pipeline parallel is not supported (every layer takes per-layer inputs "
                "from the tokens, and the KV-shared layers read earlier layers' caches)"
            )
        self.per_layer = int(cfg.raw.get("hidden_size_per_layer_input") or 0)
        if self.per_layer:
            rows = int(cfg.raw.get("vocab_size_per_layer_input") or cfg.vocab_size)
            width = cfg.num_layers * self.per_layer
            self.embed_tokens_per_layer = _Table(rows, width, dtype)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width, False, dtype)
            self.per_layer_projection_norm = RMSNorm(self.per_layer, cfg.rms_norm_eps, dtype)
            scale = torch.tensor(math.sqrt(self.per_layer), dtype=torch.float32).to(dtype)
            self.register_buffer("ple_scale", scale, persistent=False)

    def rotary_embedding(self) -> RotaryEmbedding:
        return self._rotary("sliding_attention")

    def _rotary(self, kind: str) -> RotaryEmbedding:
        """The table of a kind of layer, shared by its layers: its own entry of `rope_parameters`, over its
        head size."""
        if kind not in self.rotaries:
            cfg = self.cfg
            params = dict((cfg.raw.get("rope_parameters") or {}).get(kind) or {})
            theta = float(params.pop("rope_theta", 10000.0 if kind == "sliding_attention" else 1e6))
            if params.get("rope_type", "default") == "default":
                params = {}
            head_dim = next(spec.head_dim for spec in self.specs if spec.kind == kind)
            self.rotaries[kind] = RotaryEmbedding(head_dim, cfg.max_position_embeddings, theta, params or None)
        return self.rotaries[kind]

    def decoder_layer(self, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> nn.Module:
        spec = self.specs[layer_index]
        return Gemma4DecoderLayer(self.cfg, dtype, spec, layer_index, self._rotary(spec.kind))

    def attention_windows(self) -> list[int | None]:
        return [self.cfg.sliding_window if spec.kind == "sliding_attention" else None for spec in self.specs]

    def kv_sources(self) -> list[int]:
        return [spec.source for spec in self.specs]

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, per-layer width]: HF's get_per_layer_inputs and project_per_layer_inputs, the
        token's own row of the second table and a projection of its (scaled) embedding, each normed or
        scaled as HF does, averaged in energy (their sum over sqrt 2)."""
        if not self.per_layer:
            return None
        shape = (input_ids.shape[0], self.cfg.num_layers, self.per_layer)
        own = (self.embed_tokens_per_layer.weight[input_ids] * self.ple_scale).reshape(shape)
        projected = self.per_layer_model_projection(embedded) * (self.cfg.hidden_size**-0.5)
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + own) * (2.0**-0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | VarlenMetadata,
        activations: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final (normed) hidden states [tokens, hidden]; as Llama's, but every layer returns its whole
        output (`layer_scalar` scales the sum) and takes its per-layer inputs and this step's shared K/V."""
        assert activations is None  # (no pipeline stages)
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden)
        shared: SharedKV = {}
        keep = meta.output_rows if isinstance(meta, AttentionMetadata) else None
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            layer_input = per_layer[:, i] if per_layer is not None else None
            hidden = layer(positions, hidden, meta, layer_input, shared, keep if last else None)
        assert self.norm is not None
        hidden = self.norm(hidden)
        if keep is None:
            return hidden
        full = hidden.new_empty(positions.shape[0], hidden.shape[1])  # (the other rows: never read)
        full[keep] = hidden
        return full

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        super().load_weights(self._experts_apart(weights, cut=assembler is None), assembler)

    def _experts_apart(
        self, weights: Iterable[tuple[str, torch.Tensor]], cut: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacked experts as each expert's projections; under tensor parallel without a quantization
        assembler (which cuts after converting), each cut to this rank's intermediate rows (read whole:
        gate's and up's rows are two ranges of the stacked tensor)."""
        for name, tensor in weights:
            match = _STACKED.match(name.removeprefix("model."))
            if match is None:
                yield name, tensor
                continue
            yield from stacked_expert_pieces(name, tensor, self._moe(int(match[1])), cut)

    def _moe(self, layer: int) -> Gemma4MoE:
        moe = getattr(self.layers[layer], "moe", None)
        if moe is None:
            raise ValueError(f"{self.cfg.architecture}: layer {layer} has experts, but the config sets no MoE block")
        return moe

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        short = name.removeprefix("model.")
        if _STACKED.match(short):
            return None  # (read whole: `_experts_apart` cuts each expert)
        match = _EXPERT.match(short)
        if match is not None:
            return None if assembled else self._moe(int(match[1])).checkpoint_slices(EXPERT_PROJECTIONS[match[3]][0])
        return super().checkpoint_slices(name, assembled)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        short = name.removeprefix("model.")
        match = _ROUTER.match(short)
        if match is not None:
            return f"layers.{match[1]}.moe.{_ROUTER_PARAMS[match[2]]}", None
        match = _STACKED.match(short)
        if match is not None:  # (the loader's question whether to read it: `_experts_apart` splits it)
            return f"layers.{match[1]}.moe.{'w13' if match[2] == 'gate_up_proj' else 'w2'}", None
        match = _EXPERT.match(short)
        if match is not None:
            expert = self._moe(int(match[1])).local_expert(int(match[2]))
            if expert is None:  # (expert parallel: another rank's)
                return None
            param, half = EXPERT_PROJECTIONS[match[3]]
            return f"layers.{match[1]}.moe.{param}", expert if half is None else 2 * expert + half
        return super()._target(name)


# A layer's MoE block in a checkpoint: its router's tensors, its experts stacked or apart.
_ROUTER = re.compile(r"^layers\.(\d+)\.router\.(proj\.weight|scale|per_expert_scale)$")
_ROUTER_PARAMS = {"proj.weight": "gate.weight", "scale": "router.scale", "per_expert_scale": "router.per_expert_scale"}
_STACKED = re.compile(r"^layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Gemma4ForConditionalGeneration(VisionCheckpointText, Gemma4ForCausalLM):
    """Gemma 4's multimodal checkpoints (every size the hub publishes): their text model."""

    towers = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
