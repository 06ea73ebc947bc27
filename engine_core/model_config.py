"""A model's architecture facts, read once from its Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (Qwen2; Llama with attention_bias)
    o_proj_bias: bool  # the output projection too (Llama with attention_bias; never Qwen2)
    sliding_window: int | None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Mixture of experts (0 experts: a dense model). Qwen2/3-MoE name them `num_experts` (transformers 5 saves
    # it as `num_local_experts`) and size them `moe_intermediate_size`; Mixtral's are `num_local_experts`,
    # sized `intermediate_size`, their top-k weights always renormalized.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights are divided by their sum
    decoder_sparse_step: int = 1  # (with mlp_only_layers: which layers are MoE, see `is_moe_layer`)
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    # Each layer's attention kind, as HF names it ("sliding_attention" | "full_attention"; gpt-oss's
    # alternate); empty: every layer's the same (the sliding window, if any, in all of them).
    layer_types: tuple[str, ...] = ()
    # The context the engine serves (`--max-model-len`, which the model runner sets here); None: the model's
    # max_position_embeddings. LongRoPE picks its factors by it (engine_core/layers/rotary.py).
    max_model_len: int | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"{model_dir}/config.json names no architecture")
        if archs[0] in TEXT_OF_VISION_MODELS:
            cfg = _text_config(cfg)
        num_heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        return cls(
            architecture=archs[0],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # (none in an all-MoE config: Qwen3.5-MoE's)
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.pop("rope_theta", 10000.0)),
            rope_scaling=rope or None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=_attention_bias(cfg),
            o_proj_bias=cfg.get("model_type") not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)),
            sliding_window=_sliding_window(cfg),
            eos_token_ids=_eos_ids(model_dir, cfg),
            **_moe_fields(cfg),
            layer_types=tuple(cfg.get("layer_types") or ()),
            raw=cfg,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is the mixture of experts (Hugging Face's rule for Qwen2/3-MoE;
        every layer of Mixtral), else a dense MLP of `intermediate_size`."""
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )


# (the common part of Qwen3.5's text configs, dense and MoE: transformers' Qwen3_5TextConfig defaults)
_QWEN3_5_TEXT = dict(
    vocab_size=248320,
    num_attention_heads=16,
    head_dim=256,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)
_QWEN3_5_MOE = ("qwen3_5_moe_text", "qwen3_5_moe")  # (model types: the text config's, and a flat one)

# Vision-language checkpoints served as their text model (engine_core/models/gemma.py, qwen3_5.py):
# architecture -> the defaults of its `text_config`, which configs saved by transformers 4 list only where
# they differ.
TEXT_OF_VISION_MODELS = {
    "Gemma3ForConditionalGeneration": dict(  # (transformers' Gemma3TextConfig defaults)
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "Gemma4ForConditionalGeneration": dict(  # (transformers' Gemma4TextConfig defaults)
        model_type="gemma4_text",
        vocab_size=262144,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=512,
        hidden_activation="gelu_pytorch_tanh",
        vocab_size_per_layer_input=262144,
        hidden_size_per_layer_input=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
    ),
    "Qwen3_5ForConditionalGeneration": dict(
        _QWEN3_5_TEXT,
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_key_value_heads=4,
    ),
    "Qwen3_5MoeForConditionalGeneration": dict(  # (transformers' Qwen3_5MoeTextConfig defaults)
        _QWEN3_5_TEXT,
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_key_value_heads=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts_per_tok=8,
        num_experts=256,
    ),
}


def _text_config(cfg: dict) -> dict:
    """A vision-language config's text model: its `text_config` over the family's defaults, under the
    checkpoint's architecture (whose model class reads the text model's tensors alone)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{cfg['architectures'][0]}: config.json has no text_config")
    merged = {**TEXT_OF_VISION_MODELS[cfg["architectures"][0]], **text, "architectures": cfg["architectures"]}
    if "tie_word_embeddings" in cfg:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    if "eos_token_id" in cfg:
        merged["eos_token_id"] = cfg["eos_token_id"]
    return merged


def _moe_fields(cfg: dict) -> dict:
    # (transformers 5 saves Qwen2/3-MoE's `num_experts` as `num_local_experts` too: its attribute map)
    # Other MoE families (OLMoE, PhiMoE, ...) read as dense here and are refused by the model registry.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts or cfg.get("model_type") not in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", *_QWEN3_5_MOE):
        return _gemma4_moe_fields(cfg)
    if cfg.get("model_type") == "gpt_oss":  # (every layer MoE; a softmax over the top-k logits)
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 4),
            moe_intermediate_size=int(cfg["intermediate_size"]),
        )
    if cfg.get("model_type") == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 2),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        # (Qwen3.5-MoE's router always renormalizes: HF's Qwen3_5MoeTopKRouter; its config has no switch)
        norm_topk_prob=cfg.get("model_type") in _QWEN3_5_MOE or bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _gemma4_moe_fields(cfg: dict) -> dict:
    """Gemma 4's MoE block (`enable_moe_block`: 26B-A4B), beside each layer's dense MLP: `top_k_experts` of
    `num_experts` experts of `moe_intermediate_size`, their weights renormalized (HF's Gemma4TextRouter)."""
    if cfg.get("model_type") != "gemma4_text" or not cfg.get("enable_moe_block"):
        return {}
    return dict(
        num_experts=int(cfg["num_experts"]),
        num_experts_per_tok=int(cfg["top_k_experts"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=True,
    )


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters: {rope_theta, rope_type, ...}`; older configs have a
    top-level `rope_theta` and an optional `rope_scaling`. Read both into one dict. Parameters per layer
    type (Gemma 3's `{"full_attention": {...}, "sliding_attention": {...}}`): the full-attention layers'
    (engine_core/models/gemma.py reads the sliding layers' own)."""
    params = dict(cfg.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    params.update(cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type != "default":
        params["rope_type"] = rope_type
    return params


def _attention_bias(cfg: dict) -> bool:
    if cfg.get("model_type") == "qwen2_moe":  # (its config names it qkv_bias)
        return bool(cfg.get("qkv_bias", True))
    return bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))


def _sliding_window(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get(
        "use_sliding_window", False
    ):
        return None
    return int(window) if window else None


def _eos_ids(model_dir: Path, cfg: dict) -> frozenset[int]:
    """EOS ids from generation_config.json (what `generate` stops on), else config.json."""
    ids = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids = json.loads(gen_path.read_text()).get("eos_token_id")
    if ids is None:
        ids = cfg.get("eos_token_id")
    if ids is None:
        return frozenset()
    return frozenset(ids if isinstance(ids, list) else [ids])
