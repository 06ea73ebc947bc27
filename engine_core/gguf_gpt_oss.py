"""gpt-oss GGUF files (llama.cpp's architecture "gpt-oss", as its convert_hf_to_gguf.py writes them) seen as a
Hugging Face `GptOssForCausalLM` (engine_core/models/gpt_oss.py): the config.json fields of its metadata and the
checkpoint names of its tensors. engine_core/gguf_model.py calls these for files of this architecture.

What the converter writes, and what becomes of it:

- Attention as Llama's with biases on q/k/v/o (`attn_q.bias`, ...), in Hugging Face's rotary order (llama.cpp
  runs gpt-oss's rotary embedding in the rotate-half order: nothing to un-permute), and a learned sink logit
  per head (`attn_sinks.weight` -> `self_attn.sinks`). The norm before the MLP is `post_attention_norm`.
- The router `ffn_gate_inp` (weight and bias) -> `mlp.router`.
- Each layer's experts stacked per projection, rows first ([experts, rows, columns]): `ffn_gate_exps`,
  `ffn_up_exps` (the converter splits Hugging Face's interleaved gate_up rows into these two; with its
  fused option it writes them joined as `ffn_gate_up_exps`, gate rows first) and `ffn_down_exps`, each
  with a `.bias`. They load whole, as `mlp.experts.{gate,up,down,gate_up}_proj.*`, which the model reads as
  they are (no re-interleaving). MXFP4 experts (GGML type MXFP4, the released models') stay 4-bit: their
  blocks are repacked losslessly into Hugging Face's MXFP4 layout as they are read
  (engine_core/gguf_weights.py), and config.json declares `quantization_config: {quant_method: mxfp4}`.
  Float experts (F32, F16, BF16) load as stored. Experts in another quantized type are dequantized to
  float32 as they are read (the model holds no other quantized experts), which costs their full-precision
  memory. A file whose experts mix MXFP4 with another type is refused: the model holds every layer's
  experts one way.
- The model takes no GGUF quantization method for its linears, so every other quantized tensor
  (llama.cpp's MXFP4_MOE files keep attention and the embeddings in Q8_0) is dequantized as it is read,
  to float32, then held in the model's dtype.
- The tokenizer from the file's metadata, as for every GGUF. The file names one end token; generation ends on
  each of gpt-oss's (`END_TOKENS`, the ids its generation_config.json lists and llama.cpp stops on).
- Metadata: the usual sizes; `expert_count`, `expert_used_count`, `expert_feed_forward_length`;
  `attention.sliding_window`, in the layers llama.cpp makes sliding: the even ones, unless
  `attention.sliding_window_pattern` says otherwise (Hugging Face's default too); YaRN rotary scaling
  (`rope.scaling.type: yarn`, `.factor`, `.original_context_length`, `.yarn_beta_fast/slow`). The files carry
  no SwiGLU alpha or clamp: llama.cpp hardcodes gpt-oss's (1.702, 7.0), and so does config.json here.

No torch here (the launcher reads models too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

ARCHITECTURE = ("GptOssForCausalLM", "gpt_oss")  # (Hugging Face architecture, model_type)

# llama.cpp's gpt-oss activation, fixed in its graph (LLM_FFN_SWIGLU_OAI_MOE): the released models' values.
_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0

# The tokens a gpt-oss generation ends on: the released generation_config.json's eos ids (<|return|>,
# <|endoftext|>, <|call|>), which are also llama.cpp's end-of-generation tokens for it.
END_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensor inside block N -> Hugging Face module inside layer N (its .weight / .bias follow).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
    # Stacked experts, rows first: the model's stacked-projection names (engine_core/models/gpt_oss.py).
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
_EXPERT_WEIGHT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$")


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a gpt-oss file's tensor; None if it has no place in the model."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    if parts[2] == "attn_sinks" and parts[3] == "weight":  # (a parameter of its own: no .weight in HF's name)
        return f"model.layers.{parts[1]}.self_attn.sinks"
    if parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def is_expert_weight(gguf_name: str) -> bool:
    return _EXPERT_WEIGHT.match(gguf_name) is not None


def check_expert_types(path: Path, tensor_types: Iterable[tuple[str, str]]) -> None:
    """Refuse a file whose expert weights (among its (name, GGML type) pairs) mix MXFP4 with other types: the
    model holds every layer's experts either as MXFP4 blocks or at full precision."""
    pairs = [(name, type_name) for name, type_name in tensor_types if is_expert_weight(name)]
    mxfp4 = [name for name, type_name in pairs if type_name == "MXFP4"]
    other = [(name, type_name) for name, type_name in pairs if type_name != "MXFP4"]
    if mxfp4 and other:
        raise ValueError(
            f"{path}: gpt-oss expert weights mix MXFP4 ({mxfp4[0]}) with {other[0][1]} ({other[0][0]}); Pagoda "
            "holds a gpt-oss model's experts all as MXFP4 (kept 4-bit) or all at full precision (float types, "
            "or other quantized types dequantized at load), not both"
        )


def end_token_ids(vocabulary: list[str], eos: int | None) -> list[int]:
    """generation_config.json's eos ids: the file's eos, then those of `END_TOKENS` the vocabulary holds."""
    ids = [] if eos is None else [eos]
    for token in END_TOKENS:
        index = vocabulary.index(token) if token in vocabulary else None
        if index is not None and index not in ids:
            ids.append(index)
    return ids


def config_fields(path: Path, meta: dict, config: dict) -> dict:
    """The gpt-oss fields of config.json, over the Llama-family ones in `config`: experts, the sliding
    window and the layers it applies to, YaRN, the activation's constants."""
    p = "gpt-oss."
    layers = config["num_hidden_layers"]
    try:
        fields: dict = {
            "num_local_experts": int(meta[p + "expert_count"]),
            "num_experts_per_tok": int(meta[p + "expert_used_count"]),
            "sliding_window": int(meta[p + "attention.sliding_window"]),
        }
    except KeyError as exc:
        raise ValueError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
    # (the experts' width: HF's intermediate_size; the converter writes it as both lengths)
    fields["intermediate_size"] = int(meta.get(p + "expert_feed_forward_length") or config["intermediate_size"])
    fields["layer_types"] = layer_types(path, meta.get(p + "attention.sliding_window_pattern"), layers, period=2)
    base_swa = meta.get(p + "rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != config["rope_theta"]:
        raise ValueError(
            f"{path}: a rotary base of its own for the sliding layers (rope.freq_base_swa {base_swa}, the others "
            f"{config['rope_theta']}) is not supported"
        )
    fields.update(_rope_scaling(path, meta, p))
    fields.update(swiglu_alpha=_SWIGLU_ALPHA, swiglu_limit=_SWIGLU_LIMIT)
    return fields


def layer_types(path: Path, pattern, layers: int, period: int) -> list[str]:
    """Each layer's attention kind, as llama.cpp decides it: a period n (`period` where the file says nothing)
    makes layer i sliding when i % n < n - 1 (0: every layer), a list of booleans names the sliding layers.
    (Gemma's files use it too: engine_core/gguf_gemma.py.)"""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{path}: attention.sliding_window_pattern names {len(pattern)} layers, not {layers}")
        sliding = [bool(s) for s in pattern]
    else:
        period = period if pattern is None else int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope_scaling(path: Path, meta: dict, p: str) -> dict:
    scaling = meta.get(p + "rope.scaling.type")
    if scaling in (None, "none"):
        return {}
    if scaling != "yarn":
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported for gpt-oss (supported: yarn)")
    for key, default in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = meta.get(f"{p}rope.scaling.{key}")
        if value is not None and float(value) != default:
            raise ValueError(f"{path}: YaRN's rope.scaling.{key} {value} is not supported (only {default})")
    try:
        rope = {
            "rope_type": "yarn",
            "factor": float(meta[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get(p + "rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get(p + "rope.scaling.yarn_beta_slow") or 1.0),
            # The released models' own configs: the ramp's ends not rounded to whole dimensions, as OpenAI's
            # reference computes it. (llama.cpp rounds them; the file does not say which the model was
            # trained with, and gpt-oss's is this.)
            "truncate": False,
        }
    except KeyError as exc:
        raise ValueError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
    attention_factor = meta.get(p + "rope.scaling.yarn_attn_factor")
    if attention_factor is not None:  # (the converter writes HF's attention_factor here)
        rope["attention_factor"] = float(attention_factor)
    return {"rope_scaling": rope}
