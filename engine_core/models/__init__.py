"""Model registry: `config.architectures[0]` -> our own torch module class."""

from __future__ import annotations

from typing import Protocol

import torch

from pagoda.engine_core.layers.attention import Attention, VarlenMetadata
from pagoda.engine_core.models.bert import BertModel
from pagoda.engine_core.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagoda.engine_core.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from pagoda.engine_core.models.gpt_oss import GptOssForCausalLM
from pagoda.engine_core.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from pagoda.engine_core.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagoda.engine_core.models.phi3 import Phi3ForCausalLM
from pagoda.engine_core.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from pagoda.engine_core.pooling.config import ENCODER_ARCHITECTURES

# Every generative architecture is LlamaForCausalLM or a subclass; its methods (forward, compute_logits,
# attention_layers, load_weights) are what the model runner relies on. Each also runs as a pooling model
# (`--runner pooling`: an embedder pooling its last token, such as Qwen3-Embedding).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Mixture of experts (engine_core/models/moe.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # (engine_core/models/gpt_oss.py)
    # Gemma's layer (engine_core/models/gemma.py)
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # (its text model only)
    # per-layer inputs, KV shared across the last layers, wider full layers (engine_core/models/gemma4.py)
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # (its text model only)
    "Phi3ForCausalLM": Phi3ForCausalLM,  # fused checkpoint projections, LongRoPE (engine_core/models/phi3.py)
    # Hybrid: Gated DeltaNet linear attention (a recurrent state per sequence) and full attention
    # (engine_core/models/qwen3_5.py); the vision-language checkpoints' text model only
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}
# Encoders: pooling models only (bidirectional attention, no LM head).
ENCODER_REGISTRY: dict[str, type[BertModel]] = {"BertModel": BertModel}
assert set(ENCODER_REGISTRY) == ENCODER_ARCHITECTURES  # (the torch-free list the engine process reads)


class PoolingModel(Protocol):
    """What the pooling runner (engine_core/pooling/runner.py) relies on: the final hidden states
    [tokens, hidden] of a step of whole sequences."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor: ...

    def attention_layers(self) -> list[Attention]: ...


def _supported() -> str:
    return ", ".join(sorted([*MODEL_REGISTRY, *ENCODER_REGISTRY]))


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        if architecture in ENCODER_REGISTRY:
            raise ValueError(
                f"{architecture} is an encoder: it runs only as a pooling (embedding) model, not to generate"
            ) from None
        raise ValueError(f"architecture {architecture!r} is not supported (supported: {_supported()})") from None


def is_encoder(architecture: str) -> bool:
    return architecture in ENCODER_REGISTRY


def pooling_model_class(architecture: str) -> type[LlamaForCausalLM] | type[BertModel]:
    if architecture in ENCODER_REGISTRY:
        return ENCODER_REGISTRY[architecture]
    return model_class(architecture)
