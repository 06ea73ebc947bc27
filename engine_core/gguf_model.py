"""A GGUF file seen as a Hugging Face model directory.

A `.gguf` holds everything a model needs: hyperparameters, tokenizer and chat template in its metadata,
the weights (often quantized) in its tensors. `gguf_model_dir(path)` writes the metadata once, as
`config.json`, `generation_config.json` and the tokenizer files, into a small directory in the model
cache (`cache_root()/gguf/<name>-<hash of path, size, mtime>/`), with a marker (`MARKER`) naming the
file and listing its tensors. Everything that takes a model directory (engine, tokenizer process,
grammars, offline API) then works unchanged; the weights stay in the `.gguf` and are read from it at
every load (engine_core/gguf_weights.py). `read_gguf` + `write_model_files` also make the float32
directory of the default model (default_model.py).

No torch here: the launcher and the tokenizer process resolve models too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from pagoda.engine_core import gguf_gemma, gguf_gpt_oss, gguf_phi3, gguf_qwen35
from pagoda.engine_core.environment import cache_root

logger = logging.getLogger(__name__)

MARKER = "pagoda-gguf.json"  # in a GGUF's model directory: the file it stands for and its tensors

FLOAT_TYPES = ("F32", "F16", "BF16")
# Quantized types whose linears load into the quantization seat (engine_core/quantization/gguf.py says
# how each is stored). Others (IQ*, Q2_K, Q3_K, ...) are refused when the file is opened.
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# general.architecture -> (Hugging Face architecture, model_type). Mistral and TinyLlama GGUFs say llama;
# so do Mixtral's, with an expert_count (`_MIXTRAL`).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),  # q/k/v biases (attn_q.bias, ...)
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),  # q/k norms per head (attn_q_norm, attn_k_norm)
    # Mixtures of experts (engine_core/models/moe.py): the router is ffn_gate_inp, the experts' weights
    # ffn_{gate,up,down}_exps stacked per layer [experts, rows, columns] (older Mixtral files: one
    # ffn_{gate,up,down}.E tensor per expert); Qwen2-MoE's shared expert is ffn_*_shexp with its gate
    # ffn_gate_inp_shexp.
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    # gpt-oss: names, metadata and MXFP4 experts of its own (engine_core/gguf_gpt_oss.py)
    "gpt-oss": gguf_gpt_oss.ARCHITECTURE,
    # Gemma 2 / 3: names, metadata and norms of their own (engine_core/gguf_gemma.py)
    **gguf_gemma.ARCHITECTURES,
    # Phi-3: fused attn_qkv and ffn_up, LongRoPE factor tensors (engine_core/gguf_phi3.py)
    "phi3": gguf_phi3.ARCHITECTURE,
    # Qwen3.5 (dense and MoE): Gated DeltaNet layers' tensors, tiled value heads (engine_core/gguf_qwen35.py)
    **gguf_qwen35.ARCHITECTURES,
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# Whether the top-k routing weights are renormalised (Hugging Face's norm_topk_prob) where the file does
# not say (`expert_weights_norm`): what llama.cpp's graphs for these architectures do.
_RENORMALIZED = {"qwen2moe": False, "qwen3moe": True, "llama": True}
# llama.cpp's converter permutes the rows of q/k for the architectures whose rotary embedding it runs
# in the interleaved (GPT-J) order; the file must be un-permuted for Hugging Face's rotate-half order.
# Qwen2/3 use the rotate-half (NeoX) order in llama.cpp too, so their rows are stored as in HF. (Model
# types: Mixtral's files say llama.)
_PERMUTED_ROPE = {"llama", "mixtral"}

# GGUF tensor name inside block N -> Hugging Face Llama module name.
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked expert tensors -> each expert's checkpoint name ({expert} filled in per expert).
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
_LINEARS = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    *_EXPERT_NAMES,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: where its bytes are and what they become."""

    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    hf_name: str  # checkpoint name, e.g. model.layers.0.self_attn.q_proj.weight
    type: str  # GGML type name: F32, Q4_1, ...
    shape: tuple[int, ...]  # rows first (PyTorch order; GGUF lists the fastest dimension first)
    offset: int  # of its first byte in the file
    nbytes: int
    # The weight of a linear layer (a tied embedding is the LM head's), which a quantized type hands raw to
    # the GGUF quantization method; otherwise a quantized tensor is dequantized as it is read. (Never for
    # gpt-oss, whose model takes no quantization method: engine_core/gguf_gpt_oss.py.)
    linear: bool
    rope_heads: int  # > 0: rows to un-permute from llama.cpp's rotary order, in this many heads
    # > 0: the stacked weights of this many experts, [experts, rows, columns]; hf_name then holds
    # `{expert}` where each expert's index goes (engine_core/gguf_weights.py yields one tensor per expert)
    experts: int = 0
    # Qwen3.5's linear-attention tensors: how they go back to Hugging Face's layout ("" as stored; else a spec
    # engine_core/gguf_qwen35.py writes and reads: its value heads untiled, ssm_a's log, conv1d's [C, 1, K])
    layout: str = ""


@dataclass
class GGUFModel:
    path: Path
    config: dict  # config.json (without quantization_config)
    tensors: list[GGUFTensor]
    reader: object  # the gguf package's GGUFReader (for the tokenizer)

    def quantized_types(self) -> dict[str, int]:
        """Quantized linear weights per GGML type, e.g. {"Q4_1": 210, "Q8_0": 1}."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            if t.linear and t.type not in FLOAT_TYPES:
                counts[t.type] = counts.get(t.type, 0) + 1
        return dict(sorted(counts.items()))


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_gguf(path: Path) -> GGUFModel:
    """The file's architecture, config and tensor table, or a ValueError saying what is wrong with it."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # (the reader fails in many ways on a damaged file)
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    meta = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))} "
            "(Llama 2/3, Mistral, Mixtral, SmolLM2, TinyLlama, Qwen2 / Qwen2.5, Qwen3, Qwen2-MoE, Qwen3-MoE, "
            "gpt-oss, Gemma 2, Gemma 3, Phi-3, Qwen3.5, Qwen3.5-MoE)"
        )
    names = {t.name for t in reader.tensors}
    config = _model_config(path, meta, reader, names)
    # (A truncated file fails in the reader already: each tensor's bytes are mapped when it is listed.)
    tensors = [_tensor(path, t, config) for t in reader.tensors]
    if config["model_type"] in gguf_qwen35.MODEL_TYPES:  # (float ssm_alpha / ssm_beta beside a quantized attn_qkv)
        tensors = gguf_qwen35.float_where_merged_mix(tensors, FLOAT_TYPES)
    if arch == "gpt-oss":
        gguf_gpt_oss.check_expert_types(path, [(t.name, t.type) for t in tensors])
    return GGUFModel(path, config, tensors, reader)


def write_model_files(model: GGUFModel, out_dir: Path, quantization_config: bool) -> None:
    """config.json, generation_config.json and the tokenizer files (chat template included) of `model`.
    With `quantization_config`, config.json declares the file's quantized types (`quant_method: gguf`),
    so `--quantization auto` picks the GGUF method and `none` / `int8` / `int4` are refused; or, for a
    gpt-oss file with MXFP4 experts, those (`quant_method: mxfp4`, which the model reads itself)."""
    config = dict(model.config)
    types = model.quantized_types()
    if quantization_config and any(t.type == "MXFP4" for t in model.tensors):  # (gpt-oss's experts only)
        config["quantization_config"] = {"quant_method": "mxfp4"}
    elif quantization_config and types:
        config["quantization_config"] = {"quant_method": "gguf", "tensor_types": types}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if config["model_type"] == gguf_gpt_oss.ARCHITECTURE[1]:  # (the file names one; gpt-oss ends on three)
        generation["eos_token_id"] = gguf_gpt_oss.end_token_ids(_vocabulary(model.reader), config["eos_token_id"])
    elif config["model_type"] in gguf_gemma.MODEL_TYPES:  # (and on <end_of_turn>, the end of a chat turn)
        eot = _tokenizer_id(model.reader, "eot_token_id")
        generation["eos_token_id"] = gguf_gemma.end_token_ids(_vocabulary(model.reader), config["eos_token_id"], eot)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(model.path, out_dir, config["model_type"])


def gguf_model_dir(path: Path) -> Path:
    """The model directory standing for the GGUF file `path`, written on first use. It is keyed by the
    file's path, size and modification time, so a changed file gets a new one."""
    path = path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (target / MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Reading the metadata of %s into %s (once)", path, target)
    model = read_gguf(path)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write_model_files(model, staging, quantization_config=True)
        marker = {
            "gguf_file": str(path),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "tensors": [asdict(t) for t in model.tensors],
        }
        (staging / MARKER).write_text(json.dumps(marker) + "\n")
        try:
            staging.rename(target)  # atomic: a half-written directory is never seen
        except OSError:
            if not (target / MARKER).exists():  # (another process that raced us made it: use theirs)
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_source(model_dir: Path) -> tuple[Path, list[GGUFTensor]] | None:
    """The GGUF file a model directory stands for and its tensors; None for an ordinary directory.
    Raises if the file changed or went away since the directory was written."""
    marker_path = Path(model_dir) / MARKER
    if not marker_path.exists():
        return None
    marker = json.loads(marker_path.read_text())
    path = Path(marker["gguf_file"])
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} (the GGUF file of {model_dir}) is gone") from None
    if (stat.st_size, stat.st_mtime_ns) != (marker["size"], marker["mtime_ns"]):
        raise ValueError(f"{path} changed since it was opened; pass the .gguf file again")
    tensors = [GGUFTensor(**{**t, "shape": tuple(t["shape"])}) for t in marker["tensors"]]
    return path, tensors


def model_source(model_dir: str | Path) -> str:
    """What to show as a model's origin: the .gguf file for a GGUF's directory, else the directory."""
    marker_path = Path(model_dir) / MARKER
    if marker_path.exists():
        return str(json.loads(marker_path.read_text())["gguf_file"])
    return str(model_dir)


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - some array fields have no scalar rendering; we never need them
        return None


def _vocabulary(reader) -> list[str]:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return tokens.contents() if tokens is not None else []


def _tokenizer_id(reader, key: str) -> int | None:
    field = reader.fields.get(f"tokenizer.ggml.{key}")
    return None if field is None else int(field.contents())


def _model_config(path: Path, meta: dict, reader, names: set[str]) -> dict:
    arch = meta["general.architecture"]
    p = arch + "."
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: rotary frequency factors (rope_freqs.weight, Llama 3.1-style rope scaling) are not supported"
        )
    if arch in gguf_qwen35.ARCHITECTURES:  # (sizes, linear attention and MoE of its own; norms stored 1 + w)
        config = {**gguf_qwen35.config_fields(path, meta), gguf_gemma.NORMS_INCLUDE_ONE: True}
        return _common_config(config, meta, p, reader, names)
    try:
        num_heads = int(meta[p + "attention.head_count"])
        hidden = int(meta[p + "embedding_length"])
        architecture, model_type = _MIXTRAL if arch == "llama" and meta.get(p + "expert_count") else ARCHITECTURES[arch]
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(meta[p + "feed_forward_length"]),
            "num_hidden_layers": int(meta[p + "block_count"]),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(meta.get(p + "attention.head_count_kv") or num_heads),
            # Qwen3's heads are wider than hidden / heads: attention.key_length says so where it differs.
            "head_dim": int(
                meta.get(p + "attention.key_length") or meta.get(p + "rope.dimension_count") or hidden // num_heads
            ),
            "max_position_embeddings": int(meta[p + "context_length"]),
            "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
            "rope_theta": float(meta.get(p + "rope.freq_base") or 10000.0),
        }
    except KeyError as exc:
        raise ValueError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
    if arch == "gpt-oss":  # (its experts, sliding window and YaRN)
        config.update(gguf_gpt_oss.config_fields(path, meta, config))
    else:
        if meta.get(p + "expert_count"):
            config.update(_moe_config(path, meta, p, arch, names, config))
        scaling = meta.get(p + "rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
        elif scaling not in (None, "none"):
            raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (supported: linear)")
    if arch == "phi3":
        config.update(gguf_phi3.config_fields(path, meta, config, reader))
    config = _common_config(config, meta, p, reader, names)
    if arch in gguf_gemma.ARCHITECTURES:  # (its activation, attention scale, soft-capping, windows, norms)
        config.update(gguf_gemma.config_fields(path, meta, config))
    return config


def _common_config(config: dict, meta: dict, p: str, reader, names: set[str]) -> dict:
    """`config` with the fields every family's file gives alike: vocabulary, tying, token ids."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config.update(
        {
            "vocab_size": int(meta.get(p + "vocab_size") or 0) or (len(tokens.data) if tokens else 0),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in names,
            "mlp_bias": False,
            "bos_token_id": _tokenizer_id(reader, "bos_token_id"),
            "eos_token_id": _tokenizer_id(reader, "eos_token_id"),
            "pad_token_id": _tokenizer_id(reader, "padding_token_id"),
            "torch_dtype": "float32",
        }
    )
    return config


def _moe_config(path: Path, meta: dict, p: str, arch: str, names: set[str], config: dict) -> dict:
    """The mixture-of-experts fields of config.json, in each family's Hugging Face spelling. Layers
    without a router (ffn_gate_inp) are dense: Qwen3-MoE's mlp_only_layers."""
    try:
        experts, used = int(meta[p + "expert_count"]), int(meta[p + "expert_used_count"])
    except KeyError as exc:
        raise ValueError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
    renormalize = meta.get(p + "expert_weights_norm")
    fields: dict = {
        "num_experts_per_tok": used,
        "norm_topk_prob": _RENORMALIZED[arch] if renormalize is None else bool(renormalize),
    }
    if config["model_type"] == "mixtral":  # (Mixtral's experts are as wide as feed_forward_length)
        return {**fields, "num_local_experts": experts}
    layers = range(config["num_hidden_layers"])
    fields |= {
        "num_experts": experts,
        "moe_intermediate_size": int(meta.get(p + "expert_feed_forward_length") or config["intermediate_size"]),
        "mlp_only_layers": [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in names],
        "decoder_sparse_step": 1,
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(meta.get(p + "expert_shared_feed_forward_length") or 0)
        fields["qkv_bias"] = "blk.0.attn_q.bias" in names
    return fields


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    if model_type == gguf_phi3.ARCHITECTURE[1] and (name := gguf_phi3.hf_name(gguf_name)) is not None:
        return name
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") and parts[3].isdigit():
        # (older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight)
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{parts[2].removeprefix('ffn_')}_proj.{parts[4]}"
    return None


def _tensor(path: Path, t, config: dict) -> GGUFTensor:
    gpt_oss = config["model_type"] == gguf_gpt_oss.ARCHITECTURE[1]
    qwen35 = config["model_type"] in gguf_qwen35.MODEL_TYPES
    if gpt_oss:
        hf_name = gguf_gpt_oss.hf_name(t.name)
    elif config["model_type"] in gguf_gemma.MODEL_TYPES:
        hf_name = gguf_gemma.hf_name(t.name)
    elif qwen35:
        hf_name = gguf_qwen35.hf_name(t.name, config["num_hidden_layers"])
    else:
        hf_name = _hf_name(t.name, config["model_type"])
    if hf_name is None:
        raise ValueError(f"{path}: tensor {t.name!r} has no place in a {config['architectures'][0]}")
    type_name = t.tensor_type.name
    parts = t.name.split(".")
    kind = parts[-1]
    # (gpt-oss: no linear takes GGUF blocks raw, see GGUFTensor.linear; its stacked experts load whole)
    linear = (
        not gpt_oss
        and kind == "weight"
        and (
            (parts[0] == "blk" and parts[2] in (gguf_qwen35.LINEARS if qwen35 else _LINEARS))
            or ".experts." in hf_name
            or t.name == "output.weight"
            or (t.name == "token_embd.weight" and config["tie_word_embeddings"])
        )
    )
    mxfp4_experts = gpt_oss and type_name == "MXFP4" and gguf_gpt_oss.is_expert_weight(t.name)
    if type_name not in FLOAT_TYPES and type_name not in QUANTIZED_TYPES and not mxfp4_experts:
        raise ValueError(
            f"{path}: tensor {t.name} has GGML type {type_name}, which Pagoda does not load; supported: "
            f"{', '.join(FLOAT_TYPES + QUANTIZED_TYPES)} (and MXFP4 for gpt-oss's expert weights)"
        )
    rope_heads = 0
    if config["model_type"] in _PERMUTED_ROPE and parts[0] == "blk" and parts[2] == "attn_q":
        rope_heads = config["num_attention_heads"]
    elif config["model_type"] in _PERMUTED_ROPE and parts[0] == "blk" and parts[2] == "attn_k":
        rope_heads = config["num_key_value_heads"]
    shape = tuple(int(d) for d in reversed(t.shape))
    experts = shape[0] if not gpt_oss and parts[0] == "blk" and parts[2] in _EXPERT_NAMES else 0
    if t.name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:  # (a vector; [1, hidden] in the model)
        shape = (1, *shape)
    layout = gguf_qwen35.layout(t.name, config) if qwen35 else ""
    if linear and type_name not in FLOAT_TYPES and not gguf_qwen35.blocks_move_whole(layout, type_name):
        linear = False  # (its heads' columns split blocks: dequantized at load, then put in order)
    return GGUFTensor(
        t.name, hf_name, type_name, shape, int(t.data_offset), int(t.n_bytes), linear, rope_heads, experts, layout
    )


def _save_tokenizer(gguf_path: Path, out_dir: Path, model_type: str) -> None:
    # transformers turns GGUF tokenizer metadata (BPE or SentencePiece vocab, merges, pre-tokenizer,
    # special tokens, chat template) into a fast tokenizer; we save it as ordinary tokenizer files.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # gpt-oss's tokenizer class is the plain fast one (its checkpoints' tokenizer_config says so), built
    # directly: AutoTokenizer first reads the file's model config to choose a class, and transformers' reader
    # of gpt-oss's rope.scaling keys fails on them (transformers 5.25: it reads each key's length for its value).
    tokenizer_class = PreTrainedTokenizerFast if model_type == gguf_gpt_oss.ARCHITECTURE[1] else AutoTokenizer
    try:
        tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # (transformers raises many types here)
        raise ValueError(f"{gguf_path}: its tokenizer metadata could not be read: {exc}") from exc
    tokenizer.save_pretrained(str(out_dir))
