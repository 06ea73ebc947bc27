"""One step's flattened batch on the host (`StepInputs`), built from the scheduled requests. The model runner
sends it to the device; the GPU memory profile (engine_core/gpu_memory.py) builds the largest one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagoda.engine_core.request import Request


@dataclass
class StepInputs:
    """One step's flattened batch on the host (decodes first), before it goes to the device."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [G, T]: each token's cache slot in each KV group's blocks
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [G, B, max blocks of any sequence in the step]: one table per KV group
    num_decodes: int
    query_start_loc: np.ndarray  # [P+1] over the prefill sequences
    last_token_index: list[int]  # [B] row of each sequence's last token in the flat batch
    bulk_rows_from: int | None = None  # rows from this one on are long prompts' (model_runner.py's BULK_PROMPT_TOKENS)
    # [B] each sequence's recurrent state slot (engine_core/state_pool.py; 0: none), and whether this step
    # starts it at position 0 (its slot is zeroed first)
    state_slots: np.ndarray | None = None
    fresh_states: np.ndarray | None = None
    # [N, 2] (source row, destination row) copies of recurrent states in every recurrent layer's pools
    # (engine_core/state_snapshots.py): before the forward pass (snapshots into the slots of requests
    # resuming a cached prefix), and after it (slots into snapshots). Every rank makes them.
    state_loads: np.ndarray | None = None
    state_saves: np.ndarray | None = None


def prepare_step(
    requests: list[Request],
    counts: list[int],
    block_size: int,
    proposals: dict[str, list[int]] | None = None,
    bulk_requests: int = 0,
) -> StepInputs:
    """The step's flat inputs; a request with `proposals` computes them after its last token. The last
    `bulk_requests` requests' rows are bulk rows."""
    total = sum(counts)
    token_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    seq_lens = np.empty(len(requests), dtype=np.int64)
    block_tables = _block_tables(requests)
    offset = 0
    for i, (request, n) in enumerate(zip(requests, counts, strict=True)):
        end = request.num_computed_tokens  # already advanced by the scheduler
        start = end - n
        drafts = proposals.get(request.request_id) if proposals else None
        tokens = request.all_token_ids if not drafts else request.all_token_ids + drafts
        token_ids[offset : offset + n] = tokens[start:end]
        positions[offset : offset + n] = np.arange(start, end)
        seq_lens[i] = end
        offset += n
    row_of_token = np.repeat(np.arange(len(requests)), counts)
    slot_mapping = block_tables[:, row_of_token, positions // block_size] * block_size + positions % block_size
    first_bulk = len(counts) - bulk_requests
    num_decodes = sum(1 for n in counts[:first_bulk] if n == 1)  # (they come first; bulk chunks are longer)
    prefill_counts = np.asarray(counts[num_decodes:], dtype=np.int64)
    return StepInputs(
        token_ids,
        positions,
        slot_mapping,
        seq_lens,
        block_tables,
        num_decodes,
        query_start_loc=np.concatenate(([0], np.cumsum(prefill_counts))),
        last_token_index=(np.cumsum(counts) - 1).tolist(),
        bulk_rows_from=int(sum(counts[:first_bulk])),
        state_slots=np.array([r.state_slot for r in requests], dtype=np.int64),
        fresh_states=seq_lens == np.asarray(counts, dtype=np.int64),
    )


def prepare_decode_step(
    requests: list[Request], token_ids: list[int], positions: list[int], block_size: int
) -> StepInputs:
    """The flat inputs of a step that computes one token per request (a batch of decodes)."""
    block_tables = _block_tables(requests)
    position = np.asarray(positions, dtype=np.int64)
    rows = np.arange(len(requests))
    return StepInputs(
        np.asarray(token_ids, dtype=np.int64),
        position,
        block_tables[:, rows, position // block_size] * block_size + position % block_size,
        position + 1,
        block_tables,
        num_decodes=len(requests),
        query_start_loc=np.zeros(1, dtype=np.int64),
        last_token_index=rows.tolist(),
        state_slots=np.array([r.state_slot for r in requests], dtype=np.int64),
        fresh_states=position == 0,
    )


def _block_tables(requests: list[Request]) -> np.ndarray:
    """[G, B, max blocks]: each request's table in each KV group (zero-padded: the null block)."""
    num_groups = len(requests[0].block_ids)
    max_blocks = max(len(r.block_ids[0]) for r in requests)
    tables = np.zeros((num_groups, len(requests), max_blocks), dtype=np.int64)
    for i, request in enumerate(requests):
        for group, ids in enumerate(request.block_ids):
            tables[group, i, : len(ids)] = ids
    return tables
