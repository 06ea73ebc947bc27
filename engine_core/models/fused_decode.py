"""The fused CPU decode path of the Llama family: a decode step's layers as one C call.

A step whose tokens are all single-token decodes (and none a long prompt's bulk rows: their linears are
the layer-by-layer forward's) runs `cpu.decoder.FusedDecoder` over this stage's layers instead of the
layer-by-layer forward when:
- every projection is a float32 panel matmul, or an 8-/4-bit quantized one (kernels/quantized.py
  PackedWeight: at-load int8/int4, GGUF, GPTQ, AWQ, compressed-tensors; not FP8, not act-order GPTQ, not
  a width the quantized kernels pad), and the batch is below the size where a quantized linear switches to
  oneDNN tiles (prefill sizes);
- every layer's MLP is dense (a mixture of experts, engine_core/models/moe.py, is not);
- no layer has attention sinks and all share one sliding window (gpt-oss's do not);
- there is no tensor parallel (its all-reduces sit between the layers' ops);
- `PAGODA_DISABLE_FUSED_DECODE` is not set.
Prefill and mixed steps keep the layer-by-layer forward, whose small ops are a small share of those
steps. docs/decode-speed.md has the measurements.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from pagoda.engine_core.environment import fused_decode_disabled
from pagoda.engine_core.layers.attention import Attention, AttentionMetadata
from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama_layers import LlamaDecoderLayer, LlamaMLP
from pagoda.engine_core.parallel.distributed import TPGroup
from pagoda.kernels import ops
from pagoda.kernels.cpu.decoder import FusedDecoder, LayerTensors, Shape
from pagoda.kernels.panels import PanelWeight
from pagoda.kernels.quantized import PackedWeight

logger = logging.getLogger(__name__)


class DecoderModel(Protocol):
    """What the fused path reads of a model: `LlamaForCausalLM` (engine_core/models/llama.py), which holds the
    `FusedDecodeSeat`."""

    cfg: ModelConfig
    tp: TPGroup

    def decoder_layers(self) -> list[LlamaDecoderLayer]: ...

    def attention_layers(self) -> list[Attention]: ...


class FusedDecodeSeat:
    """Holds a model's `FusedDecoder`, built on the first decode step and again if the KV caches move."""

    def __init__(self) -> None:
        self.enabled = True  # (benchmarks and tests switch it off to run the layer-by-layer forward)
        self._decoder: FusedDecoder | None = None
        self._built_for: tuple[int, int] | None = None  # the caches' addresses it was built for

    def decoder_for(self, model: DecoderModel, meta: object, hidden: torch.Tensor) -> FusedDecoder | None:
        """The fused decoder to run this step with, or None for the layer-by-layer forward."""
        if (
            not self.enabled
            or not isinstance(meta, AttentionMetadata)
            or meta.num_decodes != hidden.shape[0]
            or (meta.bulk_rows_from is not None and meta.bulk_rows_from < hidden.shape[0])  # (their own linears)
            or hidden.device.type != "cpu"
            or hidden.dtype != torch.float32
        ):
            return None
        attention = model.attention_layers()
        first, last = attention[0], attention[-1]
        if first.key_cache is None or last.value_cache is None:
            return None
        key = (first.key_cache.data_ptr(), last.value_cache.data_ptr())
        if key != self._built_for:
            self._built_for, self._decoder = key, _build(model)
        if (
            self._decoder is not None
            and self._decoder.max_batch is not None
            and hidden.shape[0] > self._decoder.max_batch
        ):
            return None
        return self._decoder


def _build(model: DecoderModel) -> FusedDecoder | None:
    if fused_decode_disabled() or model.tp.parallel or not ops.compiled("panel_linear", torch.device("cpu")):
        return None
    layers = model.decoder_layers()
    tensors = [t for t in map(_layer_tensors, layers) if t is not None]
    if len(tensors) != len(layers):
        return None
    if len({layer.self_attn.attn.sliding_window for layer in layers}) > 1:
        return None  # (layers of different windows, gpt-oss: the C decoder takes one for all)
    attention = layers[0].self_attn
    cfg = model.cfg
    shape = Shape(
        hidden=cfg.hidden_size,
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate=cfg.intermediate_size,
        eps=cfg.rms_norm_eps,
        sliding_window=attention.attn.sliding_window,
    )
    try:
        return FusedDecoder(shape, tensors, attention.rotary.cos_sin_cache, attention.rotary.is_neox_style)
    except (ValueError, RuntimeError) as exc:
        logger.info("decode steps run layer by layer: %s", exc)
        return None


def _projection(linear: Linear) -> PanelWeight | PackedWeight | None:
    """A linear's weight as the C decoder reads it: float32 panels or an 8-/4-bit PackedWeight; None for the
    others (the plain or oneDNN float weights, FP8)."""
    if linear.panels is not None:
        return linear.panels
    return linear.quantized if isinstance(linear.quantized, PackedWeight) else None


def _layer_tensors(layer: LlamaDecoderLayer) -> LayerTensors | None:
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):
        return None  # (a mixture of experts, engine_core/models/moe.py: the C decoder runs dense MLPs only)
    if attn.attn.sinks is not None:
        return None  # (attention sinks, gpt-oss: the C decoder's attention has no sink term)
    qkv, o, gate_up, down = map(_projection, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    key_cache, value_cache = attn.attn.key_cache, attn.attn.value_cache
    if key_cache is None or value_cache is None:
        return None
    q_norm, k_norm = attn.q_norm, attn.k_norm
    return LayerTensors(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        key_cache=key_cache,
        value_cache=value_cache,
        qkv_bias=attn.qkv_proj.bias,
        o_bias=attn.o_proj.bias,
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
    )
