"""Model registry: `config.architectures[0]` -> our own torch module class."""

from __future__ import annotations

from engine_core.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

# Every architecture is LlamaForCausalLM or a subclass; its methods (forward, compute_logits,
# attention_layers, load_weights) are what the model runner relies on.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"architecture {architecture!r} is not supported (supported: {supported})") from None
