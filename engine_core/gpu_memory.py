"""Sizing the KV pool on a GPU: profile the worst step first, then give the pool what is left.

The pool is allocated once and never grows, so it must leave room for everything else a step needs:
the largest forward pass (`max_num_batched_tokens` tokens of prefill, then logits and sampling for up
to `max_num_seqs` rows) and the CUDA graphs' memory pool. We measure both before allocating the pool
(a forward pass over a small temporary cache, and one trial capture of the largest decode graph), so
the first long prompt cannot run out of memory, and log the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.engine_core.request import Request
from pagoda.engine_core.sampler import SamplingBatch, sample
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.step_inputs import StepInputs, prepare_step

logger = logging.getLogger(__name__)
GiB = 1024**3


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the card's memory
    in_use: int  # used before the pool: weights, CUDA context, other processes
    activation_peak: int  # the largest step's temporary memory beyond the weights
    graph_memory: int  # what capturing the decode graphs takes

    def kv_cache_bytes(self, utilization: float) -> int:
        """Bytes left for the KV pool so that the process uses `utilization` of the card at most."""
        return int(self.total * utilization) - self.in_use - self.activation_peak - self.graph_memory


def device_memory(device: torch.device) -> tuple[int, int]:
    """(bytes this process's caching allocator holds on `device`, the card's total) on CUDA, (0, 0)
    elsewhere. Read once the KV pool and CUDA graphs exist, after which it no longer grows much."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_reserved(device), torch.cuda.get_device_properties(device).total_memory


def profile_step(runner, num_tokens: int) -> None:
    """Run the most memory-hungry step the scheduler can produce: one prefill of `num_tokens` tokens
    (over a temporary cache just big enough), then logits and full sampling for `max_num_seqs` rows.
    Device-agnostic: on the CPU it only proves such a step runs. A pipeline stage runs its own layers
    (the LM head on the first stage)."""
    block_size = runner.block_size
    runner.allocate_kv_cache(-(-num_tokens // block_size) + 1)
    request = Request("__profile__", [0] * num_tokens, SamplingParams(max_tokens=1))
    request.block_ids = [list(range(1, runner.num_blocks))] * len(runner.kv_layout.groups)  # (the same, unread)
    request.num_computed_tokens = num_tokens
    step: StepInputs = prepare_step([request], [num_tokens], block_size)
    with torch.inference_mode():
        activations = None
        if not runner.stage.is_first:  # (a later pipeline stage: what the stage before would hand it)
            activations = torch.zeros(
                2, num_tokens, runner.model_cfg.hidden_size, dtype=runner.dtype, device=runner.device
            )
        hidden = runner.model(*runner.to_device(step), activations)
        if not runner.stage.is_first:  # no LM head on this stage
            return
        if not runner.stage.is_last:
            hidden = hidden[0]
        rows = min(runner.config.max_num_seqs, num_tokens)
        logits = runner.model.compute_logits(hidden[-rows:])
        if logits is None:  # a tensor-parallel rank other than 0: its logits went to rank 0, which samples
            return
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1)
        samplers = [Request(f"__profile_{i}__", [0], params) for i in range(rows)]
        sample(logits, SamplingBatch.from_requests(samplers, runner.model_cfg.vocab_size))


def profile_gpu_memory(runner, num_tokens: int, max_model_len: int, capture_graphs: bool) -> MemoryProfile:
    """Measure a CUDA runner whose weights are loaded and whose KV pool is not yet allocated."""
    from pagoda.engine_core.cuda_graphs import DecodeGraphs

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    profile_step(runner, num_tokens)
    torch.cuda.synchronize()
    temp_cache = runner.kv_cache.numel() * runner.kv_cache.element_size()
    activation_peak = torch.cuda.max_memory_allocated() - weights - temp_cache
    graph_memory = 0
    if capture_graphs:  # a trial capture of the largest size: the smaller ones share its pool
        graphs = DecodeGraphs(
            runner.model,
            runner.config.max_num_seqs,
            max_model_len,
            runner.block_size,
            runner.device,
            capture=True,
            num_groups=len(runner.kv_layout.groups),
        )
        free_before = torch.cuda.mem_get_info()[0]
        graphs.sizes = graphs.sizes[-1:]
        graphs.capture_all()
        graph_memory = free_before - torch.cuda.mem_get_info()[0]
        del graphs
    runner.release_kv_cache()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    profile = MemoryProfile(
        total=total, in_use=total - free, activation_peak=max(activation_peak, 0), graph_memory=max(graph_memory, 0)
    )
    logger.info(
        "GPU memory: %.2f GiB card, %.2f GiB in use before the KV pool (weights %.2f GiB), "
        "activation peak %.2f GiB at %d tokens, CUDA graphs %.2f GiB",
        total / GiB,
        profile.in_use / GiB,
        weights / GiB,
        profile.activation_peak / GiB,
        num_tokens,
        profile.graph_memory / GiB,
    )
    return profile
