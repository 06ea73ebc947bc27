"""The draft model of `draft_model` speculation: a second, smaller model with the target's vocabulary, and
its own paged KV cache.

Its KV tensors have as many blocks as the target's and are indexed by the same block ids: a request's
block table serves both models, so allocating, freeing, trimming rejected proposals and prefix caching
stay one mechanism (`KVCacheManager`). The draft computes K/V for every token the target computes, in the
same step (`ModelRunner.submit`), so wherever the target's K/V is valid the draft's is too, cached
prefixes included. The draft runs unsharded on rank 0 under tensor parallel (it needs no collectives).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pagoda.engine_core.kv_pool import allocate_pool, bind_pool, kv_bytes_per_block, plan_model_layout
from pagoda.engine_core.kv_prefault import KVPoolPrefault, prefault
from pagoda.engine_core.loader import load_model, resolve_model, weight_bytes
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.quantization import resolve_method

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, path: str, target_dir: Path, target_cfg: ModelConfig, dtype: torch.dtype, device, block_size):
        try:
            model_dir = resolve_model(path)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"--speculative-config: the draft model {path!r} cannot be loaded: {exc}") from None
        self.model_cfg = ModelConfig.from_dir(model_dir)
        check_same_vocabulary(target_dir, target_cfg, model_dir, self.model_cfg)
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.model = load_model(model_dir, self.model_cfg, dtype, device, quantization=_quantization(self.model_cfg))
        self.num_layers = len(self.model.attention_layers())
        # (one group: its blocks are the target's ids, kept as the target keeps them)
        self.kv_layout = plan_model_layout(self.model, self.model.attention_windows(), split=False)
        self.kv_cache: torch.Tensor | None = None
        self.kv_prefault: KVPoolPrefault | None = None
        logger.info(
            "Draft model %s: %d layers, %.1f MiB of weights",
            model_dir,
            self.num_layers,
            weight_bytes(self.model) / 2**20,
        )

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.kv_layout, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's pool, bound into the draft's attention layers."""
        self.release_kv_cache()
        self.kv_cache = allocate_pool(self.kv_layout, num_blocks, self.block_size, self.dtype, self.device)
        self.kv_prefault = prefault(self.kv_cache)  # (as the target's pool: engine_core/kv_prefault.py)
        bind_pool(self.model, self.kv_layout, self.kv_cache, self.block_size)

    def release_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.key_cache = attn.value_cache = None
        if self.kv_prefault is not None:
            self.kv_prefault.stop()
        self.kv_cache = self.kv_prefault = None


def _quantization(cfg: ModelConfig):
    """What the draft's checkpoint declares (full precision when nothing)."""
    return resolve_method("auto", cfg.raw)


def check_same_vocabulary(target_dir: Path, target: ModelConfig, draft_dir: Path, draft: ModelConfig) -> None:
    """A ValueError unless the draft's tokens mean what the target's do: the same vocabulary size, the same
    special token ids, and (where both have a tokenizer.json) the same token strings."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab size {draft.vocab_size} (target: {target.vocab_size})")
    if draft.eos_token_ids != target.eos_token_ids:
        problems.append(f"EOS ids {sorted(draft.eos_token_ids)} (target: {sorted(target.eos_token_ids)})")
    for key in ("bos_token_id", "pad_token_id"):
        mine, theirs = draft.raw.get(key), target.raw.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{key} {mine} (target: {theirs})")
    if not problems:
        mine, theirs = _tokens(draft_dir), _tokens(target_dir)
        if mine is not None and theirs is not None and mine != theirs:
            problems.append("a different tokenizer (tokenizer.json vocabularies differ)")
    if problems:
        raise ValueError(
            f"--speculative-config: the draft model {draft_dir} does not share the target's vocabulary: "
            + "; ".join(problems)
        )


def _tokens(model_dir: Path):
    """(vocabulary, added tokens) of a model's tokenizer.json, or None without one."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    tokenizer = json.loads(path.read_text())
    added = sorted((t["id"], t["content"]) for t in tokenizer.get("added_tokens", []))
    return tokenizer.get("model", {}).get("vocab"), added
