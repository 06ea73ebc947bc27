"""Phi-3 GGUF files (llama.cpp's architecture "phi3", as its convert_hf_to_gguf.py writes Phi-3, Phi-3.5 and
Phi-4-mini) seen as a Hugging Face `Phi3ForCausalLM` (engine_core/models/phi3.py). engine_core/gguf_model.py
calls these for files of this architecture; everything else is read as for a Llama file.

What the converter writes, and what becomes of it:

- The projections fused as Hugging Face's checkpoints hold them: `attn_qkv` (q, k and v rows) is `qkv_proj`,
  `ffn_up` (gate rows, then up rows: llama.cpp's SwiGLU takes the first half as the gate) is `gate_up_proj`;
  the shared loading code cuts them into the merged linears' parts (engine_core/models/checkpoint.py). The
  q/k rows are in Hugging Face's rotary order (llama.cpp runs Phi-3's rotary embedding rotate-half).
- LongRoPE as two F32 tensors, `rope_factors_long` and `rope_factors_short`, whose values go into
  config.json's `rope_scaling` (the tensors themselves have no place in the model), with
  `rope.scaling.original_context_length` and the attention factor `rope.scaling.attn_factor`.
- `rope.dimension_count`: the rotated dimensions of each head, fewer than the head's with Phi-4-mini's
  partial rotary (`partial_rotary_factor` = that over hidden / heads).
- `attention.sliding_window`, 0 for none.

No torch here (the launcher reads models too).
"""

from __future__ import annotations

from pathlib import Path

ARCHITECTURE = ("Phi3ForCausalLM", "phi3")  # (Hugging Face architecture, model_type)

# Tensor inside block N -> Hugging Face module inside layer N, where Phi-3's differ from Llama's.
_BLOCK_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# LongRoPE's factors -> a name the model skips (their values are read into config.json instead)
_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint name of a tensor that Phi-3 names its own way; None: read it as a Llama file's."""
    if gguf_name in _FACTORS:
        return f"model.rotary_emb.{_FACTORS[gguf_name]}"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def config_fields(path: Path, meta: dict, config: dict, reader) -> dict:
    """config.json's Phi-3 fields: head size, partial rotary, sliding window and LongRoPE."""
    p = "phi3."
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = int(meta.get(p + "rope.dimension_count") or head_dim)
    window = int(meta.get(p + "attention.sliding_window") or 0)
    fields: dict = {
        "head_dim": head_dim,
        "partial_rotary_factor": rotary_dim / head_dim,
        "sliding_window": window or None,
        "original_max_position_embeddings": int(
            meta.get(p + "rope.scaling.original_context_length") or config["max_position_embeddings"]
        ),
    }
    factors = {_FACTORS[t.name]: [float(v) for v in t.data] for t in reader.tensors if t.name in _FACTORS}
    if not factors:
        return fields
    if len(factors) != 2:
        raise ValueError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short, not only one")
    fields["rope_scaling"] = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": fields["original_max_position_embeddings"],
    }
    attention_factor = meta.get(p + "rope.scaling.attn_factor")
    if attention_factor is not None:
        fields["rope_scaling"]["attention_factor"] = float(attention_factor)
    return fields
