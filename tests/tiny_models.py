"""Tiny random-weight models of each architecture Pagoda serves, built from transformers configs: the one place
their configurations live (the tiny-model tests, the Triton model tests and the quantized tiny checkpoints
all build theirs here, with what they change named at the call).

Every input dimension is a multiple of 128 and the weights are drawn large (initializer_range 0.25), so that
greedy tokens differ between models that differ. Qwen2's QKV biases are drawn large too, so that they matter;
Mistral's, Mixtral's and Phi-3's sliding window (24) is shorter than the longer test prompts; Phi-3 stores
its projections fused (qkv_proj, gate_up_proj). The MoE models
(qwen3_moe with one dense layer, qwen2_moe with a shared expert, mixtral) route each token to 2 of 8 experts.
gpt_oss is smaller (hidden 64, 4 layers, 2 of 4 experts, head_dim 32 so its MXFP4 blocks of 32 fit) with
its layers alternating between an 8-token sliding window and full attention, YaRN over an original
context of 64 (factor 16), and its attention sinks, router and expert biases drawn large so they matter;
`save_gpt_oss_mxfp4` rewrites its checkpoint with MXFP4 experts, as the released models store them.
gemma2 and gemma3 are as small (tied embeddings, an 8-token sliding window; Gemma 2's layers alternating,
Gemma 3's 5:1 pattern shortened to 2:1 with linear rope scaling on its full layers and its own base on the
sliding ones), their soft-capping tight and their norms (HF draws them zero: its weights are 1 + w) drawn
large, so that all of them matter; their tied embedding is drawn small (its rows scaled by sqrt(hidden) would
otherwise outweigh the layers, and every prompt's tokens repeat its last); HF's eager attention (the one
with soft-capping) is their reference. qwen3_5 and qwen3_5_moe are as small, three Gated DeltaNet layers to
one full-attention layer, their (1 + w) norms and dt_bias drawn so that they matter. gemma4 has six such
layers (see its entry), its norms (w, not 1 + w) drawn around one and its layer scalars between 0.5 and 1.5;
gemma4_moe adds its MoE block, the router's scales drawn too.
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.25,
    tie_word_embeddings=False,
)

# name -> (config class, what differs from COMMON)
# The smaller models' shapes (gemma2, gemma3, qwen3_5): hidden 64, 4 layers, heads of 32
_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3": (
        transformers.LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=8)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=24)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),
    # Fused qkv_proj and gate_up_proj in the checkpoint; tests/engine_core/test_phi3.py adds LongRoPE.
    "phi3": (transformers.Phi3Config, dict(sliding_window=24, bos_token_id=1, eos_token_id=2, pad_token_id=None)),
    # Mixtures of experts: 8 experts, 2 per token, small experts so the tests run in seconds.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # layer 1 dense (of intermediate_size)
        ),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=24),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            _SMALL,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            _SMALL,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
}
# Qwen3.5: Gated DeltaNet layers (a recurrent state per sequence) and full attention; the MoE variant with a
# full layer in the middle and a linear one last
_QWEN3_5 = dict(
    _SMALL,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
)
ARCHITECTURES["qwen3_5"] = (transformers.Qwen3_5TextConfig, _QWEN3_5)
ARCHITECTURES["qwen3_5_moe"] = (
    transformers.Qwen3_5MoeTextConfig,
    dict(
        _QWEN3_5,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    ),
)
# Gemma 4: six layers (sliding, sliding, full, twice), the last two reading the K/V of the last earlier
# layer of their kind and twice as wide in their MLPs; full layers with wider heads (48) and one K/V head whose
# values are its keys; per-layer inputs of 16 per layer; proportional rope on the full layers
ARCHITECTURES["gemma4"] = (
    transformers.Gemma4TextConfig,
    dict(
        _SMALL,
        num_hidden_layers=6,
        head_dim=16,
        global_head_dim=48,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        final_logit_softcapping=4.0,
        tie_word_embeddings=True,
    ),
)
# Gemma 4 with its MoE block beside each layer's dense MLP (26B-A4B's): 2 of 8 GeGLU experts of 32
ARCHITECTURES["gemma4_moe"] = (
    transformers.Gemma4TextConfig,
    dict(ARCHITECTURES["gemma4"][1], enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32),
)
GEMMA = ("gemma2", "gemma3")
EAGER = (
    *GEMMA,
    "gemma4",
    "gemma4_moe",
)  # (HF's eager attention is their reference: soft-capping, Gemma 4's unscaled scores)
QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")  # (the rest are dense)


def build(name: str, **overrides) -> transformers.PreTrainedModel:
    """The float32 model `name` of ARCHITECTURES, its config changed by `overrides`, its weights drawn from
    seed 0 (the same model on every call)."""
    config_cls, extra = ARCHITECTURES[name]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    attention = {"attn_implementation": "eager"} if name in EAGER else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention).eval()
    if name in ("qwen2", "qwen2_moe"):  # make sure the QKV biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if name == "gpt_oss":  # (HF draws the expert biases zero: make them, and the sinks, matter)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
            torch.nn.init.normal_(layer.mlp.experts.gate_up_proj_bias, std=0.5)
            torch.nn.init.normal_(layer.mlp.experts.down_proj_bias, std=0.5)
    if name in EAGER:  # (HF draws Gemma 2/3's norms zero, so their 1 + w would be 1: make w matter)
        gemma4 = name.startswith("gemma4")  # (its norms scale by w: drawn around one)
        for module_name, parameter in model.named_parameters():
            if module_name.endswith("norm.weight"):
                torch.nn.init.normal_(parameter, mean=1.0 if gemma4 else 0.0, std=0.5 if gemma4 else 2.0)
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.05)
    if name.startswith("gemma4"):  # (HF's layer scalars and router scales are one: make them matter)
        for layer in model.model.layers:
            torch.nn.init.uniform_(layer.layer_scalar, 0.5, 1.5)
            if name == "gemma4_moe":
                torch.nn.init.uniform_(layer.router.scale, 0.5, 1.5)
                torch.nn.init.uniform_(layer.router.per_expert_scale, 0.5, 1.5)
    if name in QWEN3_5:  # (HF draws the (1 + w) norms zero and dt_bias one: make them matter)
        for module_name, parameter in model.named_parameters():
            if module_name.endswith("norm.weight") or module_name.endswith("dt_bias"):
                torch.nn.init.normal_(parameter, std=0.5)
    return model


SERVABLE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_servable(name: str, out, tokenizer_dir) -> None:
    """Write to the directory `out` a tiny model `pagoda serve` can serve: ARCHITECTURES[name], its embeddings
    tied and as wide as the vocabulary of the model in `tokenizer_dir` (SmolLM2's, 49,152: every id its
    tokenizer makes is in range), saved beside that model's tokenizer, chat template and generation config.
    Random weights: its greedy text is arbitrary but deterministic, and it serves in milliseconds."""
    import json
    import shutil
    from pathlib import Path

    source = Path(tokenizer_dir)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    build(name, vocab_size=vocab_size, tie_word_embeddings=True).save_pretrained(out)
    for file in SERVABLE_FILES:
        shutil.copy(source / file, Path(out) / file)


def save_gpt_oss_mxfp4(hf_model, model_dir, out) -> list[list[torch.Tensor]]:
    """The gpt_oss checkpoint in `model_dir` written to the new directory `out` with its experts' matrices
    quantized to MXFP4 as HF's checkpoints store them ([E, rows, cols/32, 16] blocks over each [out, in]
    matrix); returns HF's dequantization of each layer's (gate_up_proj, down_proj) in HF's layout."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagoda.kernels import mxfp4

    model_dir, out = Path(model_dir), Path(out)
    out.mkdir()
    weights = load_file(str(model_dir / "model.safetensors"))
    dequantized = []
    for i in range(len(hf_model.model.layers)):
        pair = []
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = mxfp4.quantize(weights.pop(name).transpose(1, 2))  # ([E, in, out] stored)
            weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
            pair.append(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        dequantized.append(pair)
    save_file(weights, str(out / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
    }
    (out / "config.json").write_text(json.dumps(config))
    return dequantized
