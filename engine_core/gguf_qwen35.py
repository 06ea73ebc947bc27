"""Qwen3.5 GGUF files (llama.cpp's architectures "qwen35" and "qwen35moe", as its convert_hf_to_gguf.py writes them)
seen as Hugging Face's `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (engine_core/models/qwen3_5.py): the
config.json of their metadata, the checkpoint names of their tensors and the transforms that put each tensor
back in Hugging Face's layout. engine_core/gguf_model.py calls these for files of these architectures.

What the converter writes (its Qwen3NextModel, _LinearAttentionVReorderBase and Qwen3_5TextModel classes), and
what becomes of it:

- Metadata: the Llama-family sizes (`embedding_length`, `block_count`, `attention.head_count[_kv]`,
  `attention.key_length` = head_dim, `rope.freq_base`, ...); the linear attention's as `ssm.conv_kernel`
  (linear_conv_kernel_dim), `ssm.state_size` (linear_key_head_dim), `ssm.group_count` (linear_num_key_heads),
  `ssm.time_step_rank` (linear_num_value_heads), `ssm.inner_size` (value heads x linear_value_head_dim);
  `full_attention_interval` (layer i is full attention where (i + 1) % interval == 0, as HF's default
  layer_types); `rope.dimension_count` = head_dim x partial_rotary_factor. The MoE's `expert_count`,
  `expert_used_count`, `expert_feed_forward_length`, `expert_shared_feed_forward_length` (its router always
  renormalizes). A multi-token-prediction head adds `nextn_predict_layers` blocks after the model's: they are
  skipped (as Hugging Face's `mtp.` tensors are).
- Norms that scale by (1 + w) (input, post-attention, final, q/k) are stored as 1 + w, added in float32; our
  model holds 1 + w in float32 too (`GemmaRMSNorm`), so config.json says `NORMS_INCLUDE_ONE` and they load as
  stored, exactly (as Gemma's: engine_core/gguf_gemma.py says why). The gated norm (`ssm_norm`) scales by w:
  stored as it is.
- `ssm_a` holds -exp(A_log): A_log comes back as log(-ssm_a) (`_a_log`, the float32 value whose exp is the
  stored one, so the model's -exp(A_log) is the file's value: the checkpoint's A_log for a float32 file).
  `ssm_dt.bias` is dt_bias.
- `ssm_conv1d` is the depthwise conv1d's weight squeezed to [channels, kernel]; HF's is [channels, 1, kernel].
- The projections keep Hugging Face's split (Qwen3.5 has no fused in_proj_qkvz, unlike Qwen3-Next):
  `attn_qkv` in_proj_qkv, `attn_gate` in_proj_z, `ssm_beta` in_proj_b, `ssm_alpha` in_proj_a, `ssm_out`
  out_proj. The full-attention q_proj (`attn_q`) keeps each head's query and output gate side by side.
- Value heads tiled: where the linear attention has fewer key heads than value heads, Hugging Face groups the
  value heads by key head ([k0: v0 v1, k1: v0 v1]) and the converter writes them tiled ([k0 v0, k1 v0, k0 v1,
  k1 v1]): the value rows of attn_qkv and the conv1d's value channels, the rows of attn_gate, ssm_beta and
  ssm_alpha, ssm_a and ssm_dt.bias, and the columns of ssm_out. They are put back (`untile`): rows move whole,
  so a quantized row's blocks move as they are; ssm_out's columns move in whole blocks where a head is a whole
  number of blocks, and is dequantized at load where it is not.
- Our model merges in_proj_qkv, in_proj_z, in_proj_b and in_proj_a into one linear (and q/k/v, gate/up), whose
  parts must be all quantized or all float. Quantized files may keep ssm_alpha / ssm_beta in float (BF16, F32):
  then that linear's quantized parts are dequantized at load too (`float_where_merged_mix`).

No torch here (the launcher reads models too).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# general.architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
MODEL_TYPES = {model_type for _, model_type in ARCHITECTURES.values()}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensor inside block N (its name without the suffix) -> Hugging Face tensor inside layer N.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}
# Weights that load into the quantization seat when quantized (the linears of Hugging Face's model)
LINEARS = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_qkv",
    "attn_gate",
    "ssm_beta",
    "ssm_alpha",
    "ssm_out",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
}


# Tensors our model merges into one linear (engine_core/models/qwen3_5.py; the MLPs as Llama's)
_MERGED = (
    ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
    ("attn_q", "attn_k", "attn_v"),
    ("ffn_gate", "ffn_up"),
    ("ffn_gate_shexp", "ffn_up_shexp"),
)


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The checkpoint name of a Qwen3.5 file's tensor (`{expert}` where a stacked expert tensor's index goes);
    the multi-token-prediction blocks (from `num_layers` on) under `mtp.`, which the model skips; None if it has
    no place in the model."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    block, _, rest = gguf_name.partition(".")
    index, _, tensor = rest.partition(".")
    if block != "blk" or not index.isdigit():
        return None
    if int(index) >= num_layers:
        return f"mtp.blk.{index}.{tensor}"
    if tensor not in _BLOCK_NAMES:
        return None
    return f"model.layers.{index}.{_BLOCK_NAMES[tensor]}"


def float_where_merged_mix(tensors: list, float_types: tuple[str, ...]) -> list:
    """`tensors` (GGUFTensor), those quantized linears dequantized at load (`linear` False) whose merged linear
    has a float part too: the quantization seat takes a merged linear quantized or float whole."""
    from dataclasses import replace

    by_name = {t.name: t for t in tensors}
    dequantized: set[str] = set()
    blocks = {t.name.split(".")[1] for t in tensors if t.name.startswith("blk.")}
    for block in blocks:
        for group in _MERGED:
            parts = [by_name.get(f"blk.{block}.{name}.weight") for name in group]
            present = [t for t in parts if t is not None]
            quantized = [t for t in present if t.linear and t.type not in float_types]
            if quantized and len(quantized) < len(present):
                dequantized.update(t.name for t in quantized)
    return [replace(t, linear=False) if t.name in dequantized else t for t in tensors]


def config_fields(path: Path, meta: dict) -> dict:
    """config.json's fields from a qwen35 / qwen35moe file's metadata (sizes, linear attention, MoE); the
    vocabulary and token ids are added by the caller."""
    arch = meta["general.architecture"]
    p = arch + "."
    try:
        num_heads = int(meta[p + "attention.head_count"])
        hidden = int(meta[p + "embedding_length"])
        head_dim = int(meta.get(p + "attention.key_length") or hidden // num_heads)
        layers = int(meta[p + "block_count"]) - int(meta.get(p + "nextn_predict_layers") or 0)
        interval = int(meta.get(p + "full_attention_interval") or 4)
        value_heads = int(meta[p + "ssm.time_step_rank"])
        key_heads = int(meta[p + "ssm.group_count"])
        architecture, model_type = ARCHITECTURES[arch]
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(meta.get(p + "attention.head_count_kv") or num_heads),
            "head_dim": head_dim,
            "max_position_embeddings": int(meta[p + "context_length"]),
            "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
            "rope_theta": float(meta.get(p + "rope.freq_base") or 10000.0),
            "partial_rotary_factor": int(meta.get(p + "rope.dimension_count") or head_dim // 4) / head_dim,
            "linear_conv_kernel_dim": int(meta[p + "ssm.conv_kernel"]),
            "linear_key_head_dim": int(meta[p + "ssm.state_size"]),
            "linear_num_key_heads": key_heads,
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(meta[p + "ssm.inner_size"]) // value_heads,
            "full_attention_interval": interval,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        }
        if arch == "qwen35moe":
            config |= {
                "num_experts": int(meta[p + "expert_count"]),
                "num_experts_per_tok": int(meta[p + "expert_used_count"]),
                "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
                "shared_expert_intermediate_size": int(meta.get(p + "expert_shared_feed_forward_length") or 0),
                "norm_topk_prob": True,  # (HF's Qwen3_5MoeTopKRouter and llama.cpp's graph always renormalize)
            }
        else:
            config["intermediate_size"] = int(meta[p + "feed_forward_length"])
    except KeyError as exc:
        raise ValueError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported for Qwen3.5 files")
    if value_heads % key_heads:
        raise ValueError(f"{path}: {value_heads} value heads are not a multiple of the key heads")
    return config


def layout(gguf_name: str, config: dict) -> str:
    """How a tensor goes back to Hugging Face's layout (`to_hf` / `blocks_to_hf` read it): "" as stored, else
    "kind,axis,first,key_heads,values_per_key,head_size": from index `first` of axis `axis` the value heads are
    tiled, head_size wide each; kind "v" (untile only), "a" (ssm_a: untile, then log(-x)), "conv" (untile, then
    [C, 1, K])."""
    tensor = gguf_name.partition(".")[2].partition(".")[2]
    key_heads, value_heads = config.get("linear_num_key_heads", 0), config.get("linear_num_value_heads", 0)
    per_key = value_heads // key_heads if key_heads else 1
    value_dim = config.get("linear_value_head_dim", 0)
    key_rows = 2 * key_heads * config.get("linear_key_head_dim", 0)
    specs = {
        "attn_qkv.weight": ("v", 0, key_rows, value_dim),
        "ssm_conv1d.weight": ("conv", 0, key_rows, value_dim),
        "attn_gate.weight": ("v", 0, 0, value_dim),
        "ssm_beta.weight": ("v", 0, 0, 1),
        "ssm_alpha.weight": ("v", 0, 0, 1),
        "ssm_a": ("a", 0, 0, 1),
        "ssm_dt.bias": ("v", 0, 0, 1),
        "ssm_out.weight": ("v", 1, 0, value_dim),
    }
    if tensor not in specs or not gguf_name.startswith("blk."):
        return ""
    kind, axis, first, size = specs[tensor]
    if per_key == 1 and kind == "v":
        return ""  # (as many key heads as value heads: nothing tiled)
    return f"{kind},{axis},{first},{key_heads},{per_key},{size}"


def blocks_move_whole(spec: str, ggml_type: str) -> bool:
    """Whether a quantized tensor of layout `spec` can be put back as raw blocks: rows always move whole; columns
    (ssm_out's) only where each head is a whole number of blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not spec:
        return True
    _, axis, _, _, _, size = spec.split(",")
    return axis == "0" or int(size) % GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0] == 0


def to_hf(array: np.ndarray, spec: str) -> np.ndarray:
    """A float tensor (rows first, as the file holds it) in Hugging Face's layout."""
    kind, axis, first, key_heads, per_key, size = _parse(spec)
    array = _untile(array, axis, first, key_heads, per_key, size)
    if kind == "a":
        return _a_log(array)
    if kind == "conv":
        return array.reshape(array.shape[0], 1, array.shape[1])
    return array


def blocks_to_hf(blocks: np.ndarray, spec: str, ggml_type: str) -> np.ndarray:
    """A quantized linear's raw blocks (uint8 [rows, bytes per row]) in Hugging Face's order: rows move whole;
    columns (`blocks_move_whole` said so) move in whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, axis, first, key_heads, per_key, size = _parse(spec)
    if axis == 0:
        return _untile(blocks, 0, first, key_heads, per_key, size)
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return _untile(blocks, 1, first * nbytes // values, key_heads, per_key, size * nbytes // values)


def _parse(spec: str) -> tuple[str, int, int, int, int, int]:
    kind, *numbers = spec.split(",")
    axis, first, key_heads, per_key, size = (int(n) for n in numbers)
    return kind, axis, first, key_heads, per_key, size


def _untile(array: np.ndarray, axis: int, first: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """The converter's _reorder_v_heads undone: along `axis` from `first` on, [per_key, key_heads, size] (tiled)
    back to [key_heads, per_key, size] (grouped by key head)."""
    if per_key == 1:
        return array
    moved = np.moveaxis(array, axis, 0)
    head, tiled = moved[:first], moved[first:]
    rest = tiled.shape[1:]
    grouped = tiled.reshape(per_key, key_heads, size, *rest).swapaxes(0, 1).reshape(tiled.shape)
    return np.ascontiguousarray(np.moveaxis(np.concatenate((head, grouped)), 0, axis))


def _a_log(stored: np.ndarray) -> np.ndarray:
    """A_log from the stored -exp(A_log): of the float32 values next to log(-stored), the one whose float32 exp is
    nearest the stored magnitude (exactly it for a file converted from a float32 checkpoint: that A_log). torch's
    exp, as the converter's and the model's (numpy's rounds differently in the last bit); imported here, as the
    weights are read, not where the launcher reads a file's config."""
    import torch

    magnitude = torch.from_numpy(-stored.astype(np.float32))
    guess = torch.log(magnitude.double()).float()
    best, best_error = guess, (torch.exp(guess) - magnitude).abs()
    for direction in (-torch.inf, torch.inf):
        candidate = guess
        for _ in range(2):
            candidate = torch.nextafter(candidate, torch.full_like(candidate, direction))
            error = (torch.exp(candidate) - magnitude).abs()
            better = error < best_error  # (ties: the nearest to the log)
            best, best_error = torch.where(better, candidate, best), torch.where(better, error, best_error)
    return best.numpy()
