"""Google's Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 (`Gemma3ForCausalLM`, text): the Llama family's
attention and linears with Gemma's own layer, as Hugging Face's modeling_gemma2.py / modeling_gemma3.py
compute it:

- RMSNorm scales by (1 + weight), in float32 (`GemmaRMSNorm`: the checkpoint's weight + 1 is stored at load,
  float32, so float32 steps run the plain RMSNorm ops with it);
- four norms per layer: the attention's output and the MLP's output are each normed before they join the
  residual stream (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
  pre_feedforward_layernorm (`GemmaDecoderLayer`);
- the embedding scaled by sqrt(hidden_size), that factor first rounded to the model's dtype; tied LM head;
- GeGLU MLP: gelu (tanh approximation) of the gate times up (`GemmaMLP`);
- attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- sliding-window and full attention per layer, as the config's `layer_types` say (without them, HF's
  defaults: Gemma 2 alternates from a sliding first layer, Gemma 3 has five sliding layers to one full);
- Gemma 2: attention logit soft-capping (`attn_logit_softcapping`, `Attention.softcap`: every attention
  kernel applies it) and final logit soft-capping (`final_logit_softcapping`, `compute_logits`);
- Gemma 3: q/k RMSNorm (Gemma's, per head) before the rotary embedding, and two rotary tables: the full
  layers' from the config's rope_theta and rope scaling, the sliding layers' from their own entry of
  transformers 5's per-layer-type `rope_parameters` (or transformers 4's `rope_local_base_freq`, unscaled).
  Either soft-capping is read from the config when set, so Gemma 3 configs that set them are honoured too.

Tensor and pipeline parallel work as for Llama (the norms are replicated; GeGLU's gate and up halves are
split like SwiGLU's). The fused CPU decode step (models/fused_decode.py) is switched off: the C decoder
runs Llama's layer. Checkpoints of `Gemma3ForConditionalGeneration` (a vision model around Gemma 3) load their
text model: the config's `text_config` (engine_core/model_config.py) and the tensors under
`language_model.` (the vision tower's are skipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from pagoda.engine_core.gguf_gemma import NORMS_INCLUDE_ONE
from pagoda.engine_core.layers.attention import AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama import LlamaForCausalLM
from pagoda.engine_core.models.llama_layers import LlamaDecoderLayer, LlamaMLP, RMSNorm, _bulk_after
from pagoda.engine_core.quantization.assembly import LinearAssembler
from pagoda.kernels import ops

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # (HF's names for the tanh approximation)


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma RMSNorm: x / rms(x) * (1 + w), computed in float32 and rounded to x's dtype once. `weight`
    holds 1 + w in float32 (`GemmaForCausalLM.load_weights` adds the one)."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps, torch.float32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual` (norm(x + residual), x + residual), as Llama's RMSNorm."""
        if x.dtype == torch.float32:  # (the plain ops compute exactly this in float32)
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            residual = x + residual
            return self._normed(residual), residual
        return self._normed(x)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.rms_norm(x.float(), self.weight.shape, None, self.eps) * self.weight).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)); gate and up merged as in `LlamaMLP`."""

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, bulk_rows_from).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, bulk_rows_from)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's attention and a `GemmaMLP`, each between two Gemma norms (HF's Gemma2/3DecoderLayer)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        qk_norm: bool,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ):
        super().__init__(cfg, dtype, False, rotary, GemmaMLP(cfg, dtype))
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        attention = self.self_attn
        if qk_norm:  # (Gemma 3: per head, before the rotary embedding, as LlamaAttention applies them)
            attention.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
            attention.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        attention.attn.scale = float(cfg.raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        attention.attn.softcap = float(cfg.raw.get("attn_logit_softcapping") or 0.0)
        attention.attn.sliding_window = sliding_window

    def forward(self, positions, hidden, residual, meta: AttentionMetadata | VarlenMetadata, keep=None):
        """HF's: r = x + post_attention_norm(attn(input_norm(x))); out = r + post_ff_norm(mlp(pre_ff_norm(r))),
        with each addition deferred to the next norm (fused), as the Llama layer defers its own. `keep`: as
        Llama's."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, keep)
        if keep is not None:
            residual = residual[keep]
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden, _bulk_after(meta, keep))
        return self.post_feedforward_layernorm(hidden), residual


def layer_kinds(cfg: ModelConfig, sliding_every: int) -> tuple[str, ...]:
    """Each layer's attention kind: the config's `layer_types`, else HF's default pattern (a full layer every
    `sliding_every` layers, the others sliding)."""
    if cfg.layer_types:
        if len(cfg.layer_types) != cfg.num_layers:
            raise ValueError(
                f"{cfg.architecture}: layer_types names {len(cfg.layer_types)} layers, the model has {cfg.num_layers}"
            )
        return cfg.layer_types
    return tuple(
        "full_attention" if (i + 1) % sliding_every == 0 else "sliding_attention" for i in range(cfg.num_layers)
    )


def check_gelu_tanh(cfg: ModelConfig) -> None:
    """Gemma's MLPs compute GeGLU with the tanh approximation: refuse a config naming another activation."""
    activation = cfg.raw.get("hidden_activation") or cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GELU_TANH:
        raise ValueError(f"{cfg.architecture}: hidden activation {activation!r} is not supported (gelu_pytorch_tanh)")


class GemmaEmbeddingAndHead(LlamaForCausalLM):
    """What every Gemma adds around its layers: the embedding scaled by sqrt(hidden_size), that factor first
    rounded to the model's dtype (as HF multiplies the looked-up rows), and the final logit soft-capping
    (`final_logit_softcapping`, 0: none). The fused CPU decode step stays off: the C decoder runs Llama's
    layer, not Gemma's."""

    embed_scale: torch.Tensor  # (a buffer: sqrt(hidden_size) in the weights' dtype)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        super().__init__(cfg, dtype, pooling)
        scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.final_softcap = float(cfg.raw.get("final_logit_softcapping") or 0.0)
        self.fused_decode.enabled = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        assert self.lm_head is not None
        logits = self.lm_head(hidden)
        if self.final_softcap:  # (HF: in the model's dtype, before float32; elementwise, so per vocab slice)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return self.tp.gather_last_dim(logits.float(), self.cfg.vocab_size)


class Gemma2ForCausalLM(GemmaEmbeddingAndHead):
    qk_norm = False
    sliding_every = 2  # (HF's Gemma2Config default: sliding, full, sliding, ...)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        check_gelu_tanh(cfg)
        if cfg.raw.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture}: bidirectional attention (an embedding Gemma) is not supported")
        self.kinds = layer_kinds(cfg, self.sliding_every)
        self.local_rotary: RotaryEmbedding | None = None  # (built with the first sliding layer that needs it)
        super().__init__(cfg, dtype, pooling)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_windows(self) -> list[int | None]:
        return [self.cfg.sliding_window if kind == "sliding_attention" else None for kind in self.kinds]

    def decoder_layer(self, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> LlamaDecoderLayer:
        window = self.attention_windows()[layer_index]
        if window is not None:
            rotary = self.sliding_rotary(rotary)
        return GemmaDecoderLayer(self.cfg, dtype, self.qk_norm, rotary, window)

    def sliding_rotary(self, rotary: RotaryEmbedding) -> RotaryEmbedding:
        """The sliding layers' rotary table: the model's (Gemma 2: one for all layers)."""
        return rotary

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        super().load_weights(self._in_our_layout(weights), assembler)

    def _in_our_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Norm weights as 1 + w in float32 (`GemmaRMSNorm`); the rest as they are. A GGUF file's norms hold
        1 + w already (config.json's NORMS_INCLUDE_ONE: engine_core/gguf_gemma.py says why they load as stored)."""
        include_one = bool(self.cfg.raw.get(NORMS_INCLUDE_ONE))
        for name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = tensor.float() if include_one else tensor.float() + 1.0
            yield name, tensor


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    sliding_every = 6  # (HF's Gemma3TextConfig default sliding_window_pattern)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        self.sliding_every = int(cfg.raw.get("sliding_window_pattern") or self.sliding_every)
        super().__init__(cfg, dtype, pooling)

    def sliding_rotary(self, rotary: RotaryEmbedding) -> RotaryEmbedding:
        """Gemma 3's sliding layers' own table, shared by all of them: transformers 5's
        `rope_parameters["sliding_attention"]` (its rope_theta and any scaling), else transformers 4's
        `rope_local_base_freq` (default 10,000) without scaling."""
        if self.local_rotary is None:
            cfg = self.cfg
            params = dict((cfg.raw.get("rope_parameters") or {}).get("sliding_attention") or {})
            if not params:
                params = {"rope_theta": cfg.raw.get("rope_local_base_freq") or 10000.0}
            theta = float(params.pop("rope_theta", 10000.0))
            if params.get("rope_type", "default") == "default":
                params = {}
            self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, params or None)
        return self.local_rotary


class VisionCheckpointText(LlamaForCausalLM):
    """Mixed in before a text model's class: the text model of a vision-language checkpoint. Its config's
    `text_config` (ModelConfig); its tensors under `language_model.model.` (what transformers writes for
    Gemma 3, also in 5.x) or `model.language_model.` (in-memory names, Gemma 4's), the LM head (if stored)
    under `language_model.lm_head.` or `lm_head.`; the other towers' (`towers`: vision, audio, their
    projectors) are skipped. Images are not supported."""

    towers: tuple[str, ...] = ()  # (the name prefixes of the other towers' tensors)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        super().load_weights(((self._text_name(n) or n, t) for n, t in weights), assembler)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        text_name = self._text_name(name)
        return None if text_name is None else super()._target(text_name)

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        text_name = self._text_name(name)
        return None if text_name is None else super().checkpoint_slices(text_name, assembled)

    def _text_name(self, name: str) -> str | None:
        """The text model's name for a checkpoint tensor (as its ...ForCausalLM checkpoint names it); None
        for the other towers'."""
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return ours + name.removeprefix(prefix)
        if name.startswith(("model.", "lm_head.")) and not name.startswith(self.towers):
            return name  # (already a text model's name)
        return None


class Gemma3ForConditionalGeneration(VisionCheckpointText, Gemma3ForCausalLM):
    """Gemma 3's vision-language checkpoints: their text model (`VisionCheckpointText`)."""

    towers = ("model.vision_tower.", "model.multi_modal_projector.")


_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
