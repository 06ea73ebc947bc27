"""Microsoft's Phi-3 family (`Phi3ForCausalLM`: Phi-3 and Phi-3.5 mini and medium, Phi-4-mini): the Llama
family's layers with

- fused checkpoint projections: `qkv_proj` holds the q, k and v rows in one tensor, `gate_up_proj` the gate
  and up rows. They carry our merged linears' own names, so the shared loading code cuts them into the merged
  parts, each to this rank's rows under tensor parallel, quantized at load or converted from a quantized
  checkpoint as a whole and then cut (engine_core/models/checkpoint.py, engine_core/quantization/assembly.py);
- LongRoPE (`rope_scaling` type `longrope`, or the older names `su` and `yarn`, which Hugging Face reads as
  longrope for this family) over the original context `original_max_position_embeddings`, a top-level key
  in older configs; which of its two factor lists applies is chosen once, by the context the engine serves
  (engine_core/layers/rotary.py says why, and where that departs from Hugging Face);
- partial rotary (Phi-4-mini's `partial_rotary_factor` 0.75: the first 3/4 of each head rotated);
- the config's sliding window in every layer, as Hugging Face applies it.
"""

from __future__ import annotations

import torch

from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama import LlamaForCausalLM

_ORIGINAL_CONTEXT = 4096  # (Hugging Face's Phi3Config default for original_max_position_embeddings)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        activation = cfg.raw.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {activation!r} is not supported (silu is)")
        super().__init__(cfg, dtype, pooling)

    def rotary_embedding(self) -> RotaryEmbedding:
        cfg = self.cfg
        scaling = phi3_rope_scaling(cfg)
        rotary_dim = int(cfg.head_dim * scaling.pop("partial_rotary_factor"))
        return RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            scaling,
            rotary_dim=rotary_dim,
            context_len=cfg.max_model_len,
        )


def phi3_rope_scaling(cfg: ModelConfig) -> dict:
    """The config's rotary scaling as engine_core/layers/rotary.py reads it, with `partial_rotary_factor`:
    transformers 5 writes both it and LongRoPE's original context into `rope_parameters`, older configs keep
    them at the top level and may name LongRoPE `su` (or `yarn`)."""
    scaling = dict(cfg.rope_scaling or {})
    scaling.setdefault("partial_rotary_factor", float(cfg.raw.get("partial_rotary_factor") or 1.0))
    if scaling.get("rope_type") in ("su", "yarn", "longrope"):
        scaling["rope_type"] = "longrope"
        original = cfg.raw.get("original_max_position_embeddings") or _ORIGINAL_CONTEXT
        scaling.setdefault("original_max_position_embeddings", int(original))
    return scaling
