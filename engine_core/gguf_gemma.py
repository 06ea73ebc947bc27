"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's architectures "gemma2" and "gemma3", as its convert_hf_to_gguf.py
writes them) seen as Hugging Face's `Gemma2ForCausalLM` / `Gemma3ForCausalLM` (engine_core/models/gemma.py): the
config.json fields of their metadata and the checkpoint names of their tensors. engine_core/gguf_model.py calls
these for files of these architectures.

What the converter writes, and what becomes of it (llama.cpp's loader, src/llama-model.cpp, decides the rest):

- Tensors: Llama's attention and GeGLU MLP names, and Gemma's four norms per layer: `attn_norm` (input),
  `post_attention_norm`, `ffn_norm` (the MLP's input: HF's pre_feedforward_layernorm, not Llama's
  post_attention_layernorm) and `post_ffw_norm`; Gemma 3's per-head `attn_q_norm` / `attn_k_norm`. No
  `output.weight`: the embedding is tied. q/k rows are in HF's order (llama.cpp runs Gemma's rotary embedding in
  the rotate-half order: nothing to un-permute).
- Every `*norm.weight` is stored as 1 + w (the converter adds HF's one; llama.cpp multiplies by the stored
  weight). Our GemmaRMSNorm also holds 1 + w, in float32, and adds the one to HF's checkpoints at load, so
  config.json says `NORMS_INCLUDE_ONE` and the model takes the file's norms as they are. That is exact: the
  float32 value the file holds is the one our model (and HF's, computing 1 + w in float32) multiplies by.
  Subtracting 1 here and adding it back at load would not be: for a stored value below 0.5 (w < -0.5),
  (s - 1) + 1 rounds away from s in float32.
- Attention scale: the files carry no query_pre_attn_scalar. llama.cpp scales by head_dim ** -0.5, except for
  the 27B models (46 layers for Gemma 2, 62 for Gemma 3), whose scalar is hidden / heads (Google's configs:
  144 and 168); config.json's `query_pre_attn_scalar` says the same.
- Soft-capping: Gemma 2's `attn_logit_softcapping` and `final_logit_softcapping` (llama.cpp's 50 and 30 where a
  file lacks them); Gemma 3 has no attention soft-capping and its final one only where the file sets it.
- Sliding window: `attention.sliding_window`; the sliding layers as llama.cpp makes them, layer i of every n
  but the last (Gemma 2: n = 2, sliding first; Gemma 3: n = 6), or as `attention.sliding_window_pattern` says
  where a file has one. Without a window (older Gemma 2 files; Gemma 3 files that set none), every layer
  attends to the whole context, as llama.cpp runs them.
- Rotary bases: `rope.freq_base` for every layer (Gemma 3: its full layers, with the file's linear
  `rope.scaling` if any); Gemma 3's sliding layers use `rope.freq_base_swa` (the newer converter writes it),
  else llama.cpp's fixed 10,000, never scaled.
- The tokenizer from the file's metadata, as for every GGUF. Generation ends on the file's eos, its
  `eot_token_id` and `<end_of_turn>` where the vocabulary has it (Gemma's chat turns end on it; llama.cpp
  stops there too, and the released generation configs list it).

No torch here (the launcher reads models too).
"""

from __future__ import annotations

from pathlib import Path

from pagoda.engine_core.gguf_gpt_oss import layer_types

# general.architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
MODEL_TYPES = {model_type for _, model_type in ARCHITECTURES.values()}

# config.json key (Pagoda's own): the norm weights the checkpoint holds are 1 + w already (engine_core/models/gemma.py)
NORMS_INCLUDE_ONE = "norm_weights_include_one"

_DEFAULT_PERIOD = {"gemma2": 2, "gemma3": 6}  # (llama.cpp's set_swa_pattern for each; HF's defaults too)
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}  # (llama.cpp's LLM_TYPE_27B, whose attention scale differs)
_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (0.0, 0.0)}  # (attention, final) where the file says nothing
_LOCAL_ROPE_BASE = 10000.0  # (llama.cpp's for Gemma 3's sliding layers)
END_TOKENS = ("<end_of_turn>",)

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensor inside block N -> Hugging Face module inside layer N (its .weight follows).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a Gemma file's tensor; None if it has no place in the model."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.weight"
    return None


def config_fields(path: Path, meta: dict, config: dict) -> dict:
    """The Gemma fields of config.json, over the Llama-family ones in `config` (which has the file's sizes,
    rope_theta and any linear rope_scaling already)."""
    arch = meta["general.architecture"]
    p = arch + "."
    layers = config["num_hidden_layers"]
    # llama.cpp's attention scale (see the module's docstring), as HF's query_pre_attn_scalar
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == _LAYERS_OF_27B[arch] else None
    attention_cap, final_cap = _SOFTCAPS[arch]
    fields: dict = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar or config["head_dim"],
        "final_logit_softcapping": _softcap(meta.get(p + "final_logit_softcapping"), final_cap),
        NORMS_INCLUDE_ONE: True,
    }
    if arch == "gemma2":  # (Gemma 3 has none: llama.cpp's graph applies none)
        fields["attn_logit_softcapping"] = _softcap(meta.get(p + "attn_logit_softcapping"), attention_cap)
    window = int(meta.get(p + "attention.sliding_window") or 0)
    if window:
        pattern = meta.get(p + "attention.sliding_window_pattern")
        fields["sliding_window"] = window
        fields["layer_types"] = layer_types(path, pattern, layers, period=_DEFAULT_PERIOD[arch])
    else:
        fields["sliding_window"] = None
        fields["layer_types"] = ["full_attention"] * layers
    local_base = meta.get(p + "rope.freq_base_swa")
    if arch == "gemma3":
        fields["rope_local_base_freq"] = float(local_base or _LOCAL_ROPE_BASE)
    elif local_base is not None and float(local_base) != config["rope_theta"]:
        raise ValueError(
            f"{path}: a rotary base of its own for Gemma 2's sliding layers (rope.freq_base_swa {local_base}, the "
            f"others {config['rope_theta']}) is not supported"
        )
    return fields


def _softcap(value, default: float) -> float | None:
    """A soft-capping value for config.json: the file's, else the default; None (HF's spelling) for none."""
    cap = default if value is None else float(value)
    return cap or None


def end_token_ids(vocabulary: list[str], eos: int | None, eot: int | None) -> list[int]:
    """generation_config.json's eos ids: the file's eos, its eot, then those of `END_TOKENS` the vocabulary holds."""
    ids = [i for i in (eos, eot) if i is not None]
    for token in END_TOKENS:
        index = vocabulary.index(token) if token in vocabulary else None
        if index is not None and index not in ids:
            ids.append(index)
    return list(dict.fromkeys(ids))
