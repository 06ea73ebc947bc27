"""Recurrent-state snapshots: what lets a model with recurrent layers (Qwen3.5's Gated DeltaNet) resume a
cached prefix.

A recurrent layer keeps one state per sequence, not K/V per token, so a prefix's cached KV blocks are not
enough to resume after it: the state after its last token is needed too. The engine keeps copies of
request states taken at block boundaries, keyed by the chained hash of the block that ends there (the
prefix-cache key of that block, engine_core/block_hash.py), in `capacity` extra rows of the model runner's
state pools (rows `first_row` on, after the running requests' slots). The scheduler
(engine_core/scheduler.py) makes prompt chunks end at the boundaries worth a snapshot (`SNAPSHOT_INTERVAL`
tokens apart, and the prompt's last boundary before its last token), and lists in its output the copies the
runner makes: each snapshot to a request's slot before the step's forward pass (a request resuming a cached
prefix), each slot to a snapshot after it (a chunk that ended at a boundary). A step's loads thus read
rows before its saves overwrite any of them, so a row given to a new snapshot in the same step it is read
from still gives the reader the old one.

This is bookkeeping only (which hash is in which row, least recently used first out); the runner holds
the states. Every row is a whole copy of every recurrent layer's state: the pool's size is counted with the
state pool's at start-up.
"""

from __future__ import annotations

from collections import OrderedDict

SNAPSHOT_INTERVAL = 512  # tokens between snapshots within a prompt (a multiple of the block size is used)


class StateSnapshots:
    def __init__(self, capacity: int, first_row: int):
        if capacity < 1:
            raise ValueError("a snapshot pool needs at least one row")
        self.capacity = capacity
        self.first_row = first_row
        self._row_of: OrderedDict[bytes, int] = OrderedDict()  # block hash -> row, least recently used first
        self._free = list(range(first_row + capacity - 1, first_row - 1, -1))  # (pop() gives the lowest)
        self._this_step: set[int] = set()  # rows reserved in the step being scheduled: not to be taken again
        self.saved = 0  # snapshots taken, cumulative
        self.loaded = 0  # of which resumed from, cumulative

    def __len__(self) -> int:
        return len(self._row_of)

    def lookup(self, block_hash: bytes) -> int | None:
        """The row holding the state after the block `block_hash` ends, if one does (now the most recently
        used)."""
        row = self._row_of.get(block_hash)
        if row is not None:
            self._row_of.move_to_end(block_hash)
        return row

    def load(self, block_hash: bytes) -> int:
        """`lookup` of a snapshot a request resumes from (it must be there)."""
        row = self.lookup(block_hash)
        assert row is not None, "resuming from a snapshot that is not kept"
        self.loaded += 1
        return row

    def begin_step(self) -> None:
        """A new step is being scheduled: the rows reserved for the last one hold their states now."""
        self._this_step.clear()

    def reserve(self, block_hash: bytes) -> int | None:
        """A row for the state after the block `block_hash` ends, the least recently used snapshot's where
        none is free; None where that state is kept already, or where every row is another copy of this
        step's (two copies into one row in one step would leave it holding either state)."""
        if block_hash in self._row_of:
            self._row_of.move_to_end(block_hash)
            return None
        if self._free:
            row = self._free.pop()
        else:
            oldest = next((h for h, r in self._row_of.items() if r not in self._this_step), None)
            if oldest is None:
                return None
            row = self._row_of.pop(oldest)
        self._row_of[block_hash] = row
        self._this_step.add(row)
        self.saved += 1
        return row

    def reset(self) -> int:
        """Forget every snapshot (between steps: every copy made); returns how many there were."""
        count = len(self._row_of)
        self._free.extend(self._row_of.values())
        self._row_of.clear()
        self._this_step.clear()
        return count

    def check_integrity(self) -> None:
        rows = sorted([*self._row_of.values(), *self._free])
        assert rows == list(range(self.first_row, self.first_row + self.capacity)), "snapshot rows leaked"
