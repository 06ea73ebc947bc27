"""Decode steps replayed from captured CUDA graphs.

Once a pure-decode step's inputs sit in fixed buffers, its GPU work depends only on the batch size, so
one graph per size in `capture_sizes` replays the whole forward pass with a single launch instead of
hundreds of small kernel launches. A batch is padded up to the next captured size: pad rows are
one-token sequences on the reserved null block (block 0), whose K/V writes land there harmlessly and
whose outputs are dropped. Prefill and mixed steps run eager.

Rules the captured forward must keep: no host syncs and no shape that depends on data. That is why
attention gets `max_decode_seq_len` as a constant (the buffers' full width) and the block tables are
always `max_blocks_per_seq` wide, and why a mixture-of-experts model is captured only where its fused op
runs the Triton kernel (`model_capturable`).

On the CPU there is nothing to capture; `DecodeGraphs(..., capture=False)` routes decode steps through
the same buffers and padding and runs them eager, which is how tests exercise this path without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.engine_core.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    base = [1, 2, 4] + list(range(8, max_num_seqs + 8, 8))
    return sorted({size for size in base if size < max_num_seqs} | {max_num_seqs})


def model_capturable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a CUDA graph can capture the model's forward on `device`: none of its layers reads values on
    the host. A layer that may says so with `reads_host(device)`: a mixture of experts whose fused op runs
    the torch reference, which loops over the experts the tokens chose (Triton turned off, quantized
    experts, gpt-oss's expert options; engine_core/models/moe.py, gpt_oss.py). Nor a model with recurrent
    layers: the decode graphs' inputs carry no state slots (engine_core/state_pool.py)."""
    recurrent_layers = getattr(model, "recurrent_layers", None)
    if recurrent_layers is not None and recurrent_layers():
        return False
    for module in model.modules():
        reads_host = getattr(module, "reads_host", None)
        if reads_host is not None and reads_host(device):
            return False
    return True


class DecodeGraphs:
    """Persistent decode inputs and, on CUDA, one captured graph per padded batch size."""

    def __init__(
        self,
        model: Callable,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool,
        num_groups: int = 1,
    ):
        """`num_groups`: the KV groups' count (engine_core/kv_groups.py), each with its own block table."""
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.capture = capture
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        # Pad rows write slot 0 of every group: the null block.
        self.slot_mapping = torch.zeros(num_groups, n, dtype=torch.int64, device=device)
        # Pad rows: one token, in the null block's first slot.
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(num_groups, n, self.max_blocks_per_seq, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # captured size -> the graph's output hidden states
        self.pool: tuple[int, int] | None = None  # the graphs' memory pool, from capture_all

    def padded_size(self, batch: int) -> int | None:
        """The captured size a decode batch of `batch` runs as; None if it is too large for graphs."""
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:, :size],
            num_decodes=size,
            seq_lens=self.seq_lens[:size],
            max_decode_seq_len=self.max_blocks_per_seq * self.block_size,  # constant: no data-dependent shape
            block_tables=self.block_tables[:, :size],
            query_start_loc=self.seq_lens[:0],
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        started = time.monotonic()
        free_before = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # eager once: lazy initialisation (Triton compiles) stays out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %d..%d in %.1fs, %.0f MiB",
            len(self.graphs),
            self.sizes[0],
            self.sizes[-1],
            time.monotonic() - started,
            used / 2**20,
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_ids: list[list[list[int]]],
    ) -> torch.Tensor:
        """Hidden states `[B, hidden]` for a decode batch of B <= max size (one token per sequence)."""
        batch = len(input_ids)
        size = self.padded_size(batch)
        if size is None:
            raise ValueError(f"a decode batch of {batch} exceeds the largest graph size, {self.sizes[-1]}")
        self.input_ids[:batch].copy_(torch.from_numpy(input_ids))
        self.positions[:batch].copy_(torch.from_numpy(positions))
        self.slot_mapping[:, :batch].copy_(torch.from_numpy(slot_mapping))
        self.seq_lens[:batch].copy_(torch.from_numpy(seq_lens))
        table = np.zeros((self.block_tables.shape[0], batch, self.max_blocks_per_seq), dtype=np.int64)
        for row, tables in enumerate(block_ids):
            for group, ids in enumerate(tables):
                table[group, row, : len(ids)] = ids
        self.block_tables[:, :batch].copy_(torch.from_numpy(table))
        self._pad_rows(batch, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:batch]
        return self._forward(size)[:batch]

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows start..end become pad rows again: left as they were, they would still hold an earlier
        request's slots, and writing a pad row's K/V there would corrupt a live block."""
        if start < end:
            self.input_ids[start:end] = 0
            self.positions[start:end] = 0
            self.slot_mapping[:, start:end] = 0
            self.seq_lens[start:end] = 1
            self.block_tables[:, start:end] = 0
