"""Turns a scheduled step into model inputs, runs the model and samples.

Owns the model, the KV cache tensors (one key and one value tensor per layer, bound into each attention
layer) and the sampler. The batch is laid out decodes first, so attention serves all single-token
queries in one batched call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.config import EngineConfig, resolve_dtype
from engine_core.layers.attention import AttentionMetadata
from engine_core.loader import load_model
from engine_core.model_config import ModelConfig
from engine_core.protocol import TokenLogprobs
from engine_core.request import Request
from engine_core.sampler import SamplingBatch, sample
from engine_core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> new token, for requests whose prompt is fully computed
    logprobs: dict[str, TokenLogprobs]  # request id -> packed logprobs, when asked for


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * element


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir, model_cfg: ModelConfig):
        self.config = config
        self.model_cfg = model_cfg
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model = load_model(model_dir, model_cfg, self.dtype, self.device)
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        return self.config.kv_cache_memory // kv_bytes_per_block(self.model_cfg, self.block_size, self.dtype)

    def _allocate_kv_cache(self) -> None:
        cfg = self.model_cfg
        shape = (cfg.num_layers, 2, self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty: pages are touched only as blocks are used, so a large pool costs nothing up front.
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for layer_index, attn in enumerate(self.model.attention_layers()):
            attn.key_cache = self.kv_cache[layer_index, 0]
            attn.value_cache = self.kv_cache[layer_index, 1]

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        order = sorted(range(len(sched.requests)), key=lambda i: sched.num_scheduled_tokens[i] != 1)
        requests = [sched.requests[i] for i in order]
        counts = [sched.num_scheduled_tokens[i] for i in order]
        input_ids, positions, meta, last_token_index = self._prepare(requests, counts)
        hidden = self.model(input_ids, positions, meta)
        sampling = [(r, last_token_index[i]) for i, r in enumerate(requests) if r.num_computed_tokens == r.num_tokens]
        if not sampling:
            return StepResult({}, {})
        rows = torch.tensor([index for _, index in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sampling_requests = [r for r, _ in sampling]
        out = sample(logits, SamplingBatch.from_requests(sampling_requests, self.model_cfg.vocab_size))
        sampled = {r.request_id: t for r, t in zip(sampling_requests, out.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sampling_requests, out.logprobs) if lp is not None}
        return StepResult(sampled, logprobs)

    def _prepare(self, requests: list[Request], counts: list[int]):
        bs = self.block_size
        total = sum(counts)
        token_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        seq_lens = np.empty(len(requests), dtype=np.int64)
        max_blocks = max(len(r.block_ids) for r in requests)
        block_tables = np.zeros((len(requests), max_blocks), dtype=np.int64)
        offset = 0
        for i, (request, n) in enumerate(zip(requests, counts)):
            end = request.num_computed_tokens  # already advanced by the scheduler
            start = end - n
            token_ids[offset:offset + n] = request.all_token_ids[start:end]
            positions[offset:offset + n] = np.arange(start, end)
            seq_lens[i] = end
            block_tables[i, :len(request.block_ids)] = request.block_ids
            offset += n
        cum = np.cumsum(counts)
        row_of_token = np.repeat(np.arange(len(requests)), counts)
        slot_mapping = block_tables[row_of_token, positions // bs] * bs + positions % bs
        num_decodes = sum(1 for n in counts if n == 1)
        prefill_counts = np.asarray(counts[num_decodes:], dtype=np.int64)
        query_start_loc = np.concatenate(([0], np.cumsum(prefill_counts)))
        to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=to(slot_mapping), num_decodes=num_decodes,
            seq_lens=to(seq_lens), max_decode_seq_len=int(seq_lens[:num_decodes].max(initial=0)),
            block_tables=to(block_tables), query_start_loc=to(query_start_loc))
        return to(token_ids), to(positions), meta, (cum - 1).tolist()
