"""Rank 0's messages to the other ranks: one per step, one to stop, and under pipeline parallel one when
rank 0 runs a step's LM head (the first stage's other tensor-parallel ranks join it then).

A step message is the step's integer arrays (StepInputs, and the rows the LM head runs on) as raw bytes
behind a small msgpack header giving their shapes; no pickle. Layout: a 4-byte little-endian header
length, the header, zero padding to 8 bytes, then each array's int64 bytes in `_ARRAYS` order.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from pagoda.engine_core.model_runner import LogitsRows
from pagoda.engine_core.step_inputs import StepInputs

_ARRAYS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "seq_lens",
    "block_tables",
    "query_start_loc",
    "state_slots",
    "fresh_states",
    "state_loads",
    "state_saves",
    "prompt_spans",
    "sample_rows",
)
STEP, STOP, HEAD = 0, 1, 2


class _Header(msgspec.Struct, array_like=True):
    kind: int
    num_decodes: int = 0
    shapes: list[list[int]] = []
    bulk_rows_from: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Header)


@dataclass
class StepMessage:
    """What a worker rank needs for one step."""

    step: StepInputs
    rows: LogitsRows


def _framed(header: _Header) -> bytes:
    body = _encoder.encode(header)
    pad = -(4 + len(body)) % 8
    return len(body).to_bytes(4, "little") + body + bytes(pad)


def encode_step(step: StepInputs, rows: LogitsRows) -> list[bytes | memoryview]:
    """The parts of one step's message (the ring writes them back to back)."""
    arrays = [
        np.ascontiguousarray(step.token_ids, dtype=np.int64),
        np.ascontiguousarray(step.positions, dtype=np.int64),
        np.ascontiguousarray(step.slot_mapping, dtype=np.int64),
        np.ascontiguousarray(step.seq_lens, dtype=np.int64),
        np.ascontiguousarray(step.block_tables, dtype=np.int64),
        np.ascontiguousarray(step.query_start_loc, dtype=np.int64),
        _or_empty(step.state_slots),
        _or_empty(step.fresh_states),
        _or_empty(step.state_loads),
        _or_empty(step.state_saves),
        np.ascontiguousarray(rows.prompt_spans, dtype=np.int64),
        np.ascontiguousarray(rows.sample_rows, dtype=np.int64),
    ]
    header = _Header(STEP, step.num_decodes, [list(a.shape) for a in arrays], step.bulk_rows_from)
    return [_framed(header), *(a.reshape(-1).data.cast("B") if a.size else b"" for a in arrays)]


def _or_empty(array: np.ndarray | None) -> np.ndarray:
    return np.zeros(0, dtype=np.int64) if array is None else np.ascontiguousarray(array, dtype=np.int64)


def encode_stop() -> list[bytes | memoryview]:
    return [_framed(_Header(STOP))]


def encode_head() -> list[bytes | memoryview]:
    return [_framed(_Header(HEAD))]


def decode(buffer: bytes | memoryview) -> StepMessage | int:
    """A step message (its arrays copied out of `buffer`, which the ring reuses), or STOP or HEAD."""
    view = memoryview(buffer).cast("B")
    length = int.from_bytes(view[:4], "little")
    header = _decoder.decode(view[4 : 4 + length])
    if header.kind in (STOP, HEAD):
        return header.kind
    if header.kind != STEP or len(header.shapes) != len(_ARRAYS):
        raise ValueError(f"malformed step message (kind {header.kind})")
    offset = 4 + length + (-(4 + length) % 8)
    arrays = {}
    for name, shape in zip(_ARRAYS, header.shapes, strict=True):
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(view, dtype=np.int64, count=count, offset=offset).reshape(shape).copy()
        offset += count * 8
    if offset != len(view):
        raise ValueError(f"step message has {len(view)} bytes, its header describes {offset}")
    step = StepInputs(
        arrays["token_ids"],
        arrays["positions"],
        arrays["slot_mapping"],
        arrays["seq_lens"],
        arrays["block_tables"],
        header.num_decodes,
        arrays["query_start_loc"],
        last_token_index=[],  # (rank 0 samples; the rows to join are in `rows`)
        bulk_rows_from=header.bulk_rows_from,
        state_slots=arrays["state_slots"],
        fresh_states=arrays["fresh_states"].astype(bool),
        state_loads=arrays["state_loads"].reshape(-1, 2),
        state_saves=arrays["state_saves"].reshape(-1, 2),
    )
    return StepMessage(step, LogitsRows(arrays["prompt_spans"], arrays["sample_rows"]))
