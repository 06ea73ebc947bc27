"""Runs the model over a step of whole prompts (no KV cache) and pools each request's output."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pagoda.engine_core.config import EngineConfig, resolve_dtype
from pagoda.engine_core.environment import configure_kernels
from pagoda.engine_core.layers.attention import VarlenMetadata
from pagoda.engine_core.layers.linear import onednn_rows
from pagoda.engine_core.loader import load_pooling_model, weight_bytes
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.pooling import pooler
from pagoda.engine_core.pooling.config import PoolerConfig
from pagoda.engine_core.pooling.scheduler import PoolingRequest
from pagoda.engine_core.quantization import resolve_method

logger = logging.getLogger(__name__)


class PoolingRunner:
    num_blocks = 0  # (no KV cache: what EngineReady reports)

    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, pooler_config: PoolerConfig):
        configure_kernels(config.int8_activations)
        self.config = config
        self.pooler = pooler_config
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.quantization = resolve_method(config.quantization, model_cfg.raw)
        fp8_matmul = {"auto": None, "on": True, "off": False}[config.fp8_matmul]
        self.model = load_pooling_model(
            model_dir, model_cfg, self.dtype, self.device, config.load_format, self.quantization, fp8_matmul
        )
        self.weight_bytes = weight_bytes(self.model)
        logger.info(
            "Weights: %s, %.1f MiB in memory",
            "full precision" if self.quantization is None else self.quantization.describe(),
            self.weight_bytes / 2**20,
        )

    @torch.inference_mode()
    def execute(self, requests: list[PoolingRequest]) -> list[np.ndarray]:
        """Each request's float32 output ([hidden], or [tokens, hidden] for "token_embed"), in order."""
        lens = [len(r.prompt_token_ids) for r in requests]
        total = sum(lens)
        # The packed CPU matmuls run at a few row counts only (layers/linear.py `onednn_rows`), padding their
        # input to one per call: a copy per layer. A step padded once, here, with a sequence of its own that
        # nothing reads, needs none of those copies.
        padding = onednn_rows(total) - total if self.device.type == "cpu" else 0
        sizes = lens + [padding] if padding else lens
        starts = np.concatenate(([0], np.cumsum(sizes)))
        token_ids = np.zeros(total + padding, dtype=np.int64)
        token_ids[:total] = np.concatenate([np.asarray(r.prompt_token_ids, dtype=np.int64) for r in requests])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
        to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        hidden = self.model(to(token_ids), to(positions), VarlenMetadata(to(starts)))
        params = [r.params for r in requests]
        results = pooler.outputs(
            hidden, starts[: len(lens)].tolist(), lens, params, self.pooler.pooling_type, self.pooler.normalize
        )
        return [t.numpy() for t in results]
