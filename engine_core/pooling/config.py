"""How a pooling model pools, read once from its directory: sentence-transformers' `modules.json`
(a `Pooling` module's `1_Pooling/config.json`, a `Normalize` module), `sentence_bert_config.json`
(`max_seq_length`) and config.json's Matryoshka declaration; `--pooling-type` / `--normalize` override."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.protocol import PoolingInfo

logger = logging.getLogger(__name__)

# Architectures that are encoders: pooling models only (engine_core/models has their classes).
ENCODER_ARCHITECTURES = frozenset({"BertModel"})
# 1_Pooling/config.json's flags -> our pooling types (others, e.g. max or weighted mean, are refused)
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # "mean", "cls" or "last"
    normalize: bool
    hidden_size: int
    max_seq_length: int | None  # sentence-transformers' limit on input tokens, when it sets one
    matryoshka: bool
    matryoshka_dimensions: list[int] | None

    def info(self) -> PoolingInfo:
        return PoolingInfo(
            self.hidden_size, self.pooling_type, self.normalize, self.matryoshka, self.matryoshka_dimensions
        )


def runs_pooling(config: EngineConfig, architecture: str) -> bool:
    """Whether `config` on a model of this architecture is a pooling engine (`--runner`; auto: encoders)."""
    if config.runner == "auto":
        return architecture in ENCODER_ARCHITECTURES
    return config.runner == "pooling"


def will_pool(config: EngineConfig) -> bool:
    """`runs_pooling` before the model is resolved, without importing torch (the engine process decides
    how its threads wait before torch loads): a model that is not a local directory counts as generating
    unless `--runner pooling` says otherwise."""
    if config.runner != "auto" or config.model is None:
        return config.runner == "pooling"
    try:
        architectures = json.loads((Path(config.model).expanduser() / "config.json").read_text())["architectures"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(architectures) and runs_pooling(config, architectures[0])


def pooler_config(config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, encoder: bool) -> PoolerConfig:
    st_type, st_normalize = _sentence_transformers_pooling(model_dir)
    pooling_type = config.pooling_type or st_type or ("cls" if encoder else "last")
    normalize = config.normalize if config.normalize is not None else st_normalize
    raw = model_cfg.raw
    dims = raw.get("matryoshka_dimensions")
    max_seq_length = _read(model_dir / "sentence_bert_config.json").get("max_seq_length")
    pooler = PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=model_cfg.hidden_size,
        max_seq_length=int(max_seq_length) if max_seq_length else None,
        matryoshka=bool(raw.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=[int(d) for d in dims] if dims else None,
    )
    logger.info(
        "Pooling model: %s pooling, %snormalized, %d dimensions%s",
        pooler.pooling_type,
        "" if pooler.normalize else "not ",
        pooler.hidden_size,
        " (Matryoshka)" if pooler.matryoshka else "",
    )
    return pooler


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool]:
    """(pooling type from the Pooling module, whether a Normalize module follows); (None, True) for a
    model without modules.json (vLLM's default: embeddings are normalized)."""
    modules = _read(model_dir / "modules.json", [])
    if not modules:
        return None, True
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            pooling_type = _pooling_mode(_read(model_dir / module.get("path", "") / "config.json"))
        elif kind.endswith(".Normalize"):
            normalize = True
    return pooling_type, normalize


def _pooling_mode(pooling: dict) -> str | None:
    if "pooling_mode" in pooling:  # newer sentence-transformers write one name
        mode = {"mean": "mean", "cls": "cls", "lasttoken": "last", "last": "last"}.get(pooling["pooling_mode"])
        if mode is None:
            raise ValueError(f"sentence-transformers pooling mode {pooling['pooling_mode']!r} is not supported")
        return mode
    chosen = [mode for key, mode in _ST_MODES.items() if pooling.get(key)]
    unsupported = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if unsupported or len(chosen) > 1:
        raise ValueError(f"sentence-transformers pooling {pooling} is not supported: one of mean, cls or lasttoken")
    return chosen[0] if chosen else None


def _read(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {} if default is None else default
