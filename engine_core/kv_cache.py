"""Per-request block tables on top of the block pool, one per KV group, with automatic prefix caching.

The model's layers share the pool in groups by attention kind (engine_core/kv_groups.py). A request has
a block table per group, all as long as its tokens need; a sliding-window group gives back the blocks
that lie wholly before the window of the request's next token as it grows, and the null block takes their
place in its table (the attention kernels never read there). So a sliding group holds at most its
window's blocks plus the ones the next step writes, while a full-attention group keeps them all.

A request's full blocks are published in the pool's prefix cache under their chained content hash (and
their group) once the scheduler has scheduled their tokens. A new request first takes the longest run
of cached blocks that matches its prompt and that every group can resume from: full groups need every
block before the resume point, sliding groups only those of the window before it, and a model's recurrent
layers a snapshot of their state taken at that point (engine_core/state_snapshots.py). It takes them (one
more reference each, no compute) and computes only the rest; the last prompt token is always computed,
because its logits are needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.engine_core.block_hash import extend_block_hashes
from pagoda.engine_core.block_pool import BlockPool, KVCacheBlock
from pagoda.engine_core.request import Request
from pagoda.engine_core.state_pool import StatePool
from pagoda.engine_core.state_snapshots import SNAPSHOT_INTERVAL, StateSnapshots


class KVCacheManager:
    """Gives each request the blocks its tokens need, in every group, on demand, and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_caching: bool = True,
        windows: Sequence[int | None] = (None,),
        state_slots: int = 0,
        state_snapshots: int = 0,
    ):
        """`windows`: each KV group's sliding window (None: full attention); one full group by default.
        `state_slots`: the recurrent group's slots (engine_core/state_pool.py; 0: the model has none).
        `state_snapshots`: rows kept for recurrent states at block boundaries, after the slots' rows
        (engine_core/state_snapshots.py); a model with recurrent layers resumes no cached prefix without
        them."""
        if len(windows) > 255:
            raise ValueError(f"{len(windows)} KV groups: at most 255")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.states = StatePool(state_slots) if state_slots else None
        self.snapshots = StateSnapshots(state_snapshots, state_slots + 1) if state_slots and state_snapshots else None
        if self.states is not None and self.snapshots is None:
            self.enable_caching = False  # (nothing to resume the recurrent layers from)
        # Prompt chunks of a recurrent model end at these multiples of the block size (and at the prompt's
        # last boundary), where the state is snapshotted.
        self.snapshot_interval = max(1, SNAPSHOT_INTERVAL // block_size) * block_size
        # Admission keeps a few blocks spare so running requests can grow without instant preemption.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._blocks_of: dict[str, list[list[KVCacheBlock]]] = {}  # [group][block index]
        self._num_cached_blocks: dict[str, int] = {}  # blocks of each request already published
        self._num_released: dict[str, list[int]] = {}  # per group: leading blocks looked at for release
        self.prefix_cache_queries = 0  # prompt tokens looked up, cumulative
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def block_hashes(self, request: Request) -> list[bytes]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return request.block_hashes

    def computed_blocks(self, request: Request) -> list[list[KVCacheBlock]]:
        """The longest run of cached blocks matching the start of a request that has none yet, leaving at
        least its last token to compute: per block index, the block of each group (the null block where a
        sliding group does not need it). Empty for a request that must compute them all."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return []
        hashes = self.block_hashes(request)[: (request.num_tokens - 1) // self.block_size]
        found = [[self.pool.lookup(_key(h, g)) for h in hashes] for g in range(self.num_groups)]
        resume = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                resume = min(resume, next((i for i, block in enumerate(found[g]) if block is None), resume))
        snapshots = self.snapshots  # (a recurrent model's layers also need their state at the resume point)
        while resume > 0 and (
            not self._windows_cached(found, resume)
            or (snapshots is not None and snapshots.lookup(hashes[resume - 1]) is None)
        ):
            resume -= 1
        hits = []
        for index in range(resume):
            row = []
            for g in range(self.num_groups):
                block = found[g][index]
                row.append(block if block is not None and self._needed(g, index, resume) else self.pool.null_block)
            hits.append(row)
        return hits

    def _needed(self, group: int, index: int, resume: int) -> bool:
        """Whether block `index` of `group` is read by the token at position resume x block size."""
        return index >= self._first_in_window(group, resume * self.block_size)

    def _first_in_window(self, group: int, position: int) -> int:
        """The first block of `group` that the token at `position` reads (it sees keys from position + 1 -
        window on; everything in a full group)."""
        window = self.windows[group]
        return 0 if window is None else max(0, (position + 1 - window) // self.block_size)

    def _windows_cached(self, found: list[list[KVCacheBlock | None]], resume: int) -> bool:
        for g, window in enumerate(self.windows):
            if window is not None:
                first = self._first_in_window(g, resume * self.block_size)
                if any(block is None for block in found[g][first:resume]):
                    return False
        return True

    def snapshot_cap(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens of a request about to be computed from position `start`, cut to end at its next
        snapshot point (where a recurrent model's state is worth keeping): every `snapshot_interval` tokens
        of its prompt, and the prompt's last block boundary before its last token (what a longer prompt
        starting with it, a next turn, resumes from)."""
        last = self._last_snapshot_point(request)
        if last is None or start >= last:
            return num_new
        point = min(last, (start // self.snapshot_interval + 1) * self.snapshot_interval)
        return min(num_new, point - start)

    def _last_snapshot_point(self, request: Request) -> int | None:
        """The prompt's last block boundary before its last token; None where no snapshot is taken."""
        if self.snapshots is None or not self.enable_caching or not request.reads_prefix_cache:
            return None
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def snapshot_save(self, request: Request) -> tuple[int, int] | None:
        """(slot, row): the copy that keeps a request's state as its step leaves it, where the step ended at
        a snapshot point not kept yet; None otherwise."""
        last = self._last_snapshot_point(request)
        computed = request.num_computed_tokens
        if last is None or computed == 0 or computed > last:
            return None
        if computed != last and computed % self.snapshot_interval:
            return None
        assert self.snapshots is not None  # (as _last_snapshot_point checked)
        row = self.snapshots.reserve(self.block_hashes(request)[computed // self.block_size - 1])
        return None if row is None else (request.state_slot, row)

    def snapshot_load(self, request: Request, num_hit_blocks: int) -> tuple[int, int]:
        """(row, slot): the copy that gives a request resuming after `num_hit_blocks` cached blocks its
        recurrent state there."""
        assert self.snapshots is not None
        return self.snapshots.load(self.block_hashes(request)[num_hit_blocks - 1]), request.state_slot

    def head_hash(self, request: Request) -> bytes | None:
        """The hash of the request's first block, if it has a full one (and caching is on)."""
        if not self.enable_caching:
            return None
        hashes = self.block_hashes(request)
        return hashes[0] if hashes else None

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """New blocks, over all groups, for `num_new_tokens` more tokens after `num_hit_blocks` hits."""
        total_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        tables = self._blocks_of.get(request.request_id)
        have = (len(tables[0]) if tables else 0) + num_hit_blocks
        return max(0, -(-total_tokens // self.block_size) - have) * self.num_groups

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        admitting: bool = False,
        hit_blocks: Sequence[Sequence[KVCacheBlock]] = (),
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` (after taking `hit_blocks`, cached
        blocks that hold its next tokens, as `computed_blocks` gives them); False, with nothing taken,
        if they don't fit (a running request's blocks that left its windows are given back all the same)."""
        if request.request_id in self._blocks_of:  # (first: what it gives back may make the room)
            self._release_outside_windows(request, request.num_computed_tokens)
        needed = self.num_blocks_needed(request, num_new_tokens, len(hit_blocks))
        reserve = self.watermark_blocks if admitting else 0
        null = self.pool.null_block
        taken = [block for row in hit_blocks for block in row if block is not null]
        hits_in_free_queue = sum(1 for b in taken if b.ref_cnt == 0)  # taking them uses free blocks
        if needed + hits_in_free_queue + reserve > self.pool.num_free_blocks:
            return False
        if self.states is not None:
            slot = self.states.take(request.request_id)
            if slot is None:
                return False
            request.state_slot = slot
        tables = self._blocks_of.setdefault(request.request_id, [[] for _ in self.windows])
        released = self._num_released.setdefault(request.request_id, [0] * self.num_groups)
        if hit_blocks:
            self.pool.touch(taken)
            for g, table in enumerate(tables):
                table.extend(row[g] for row in hit_blocks)
                # (a sliding group's hits start with null blocks: nothing there to give back)
                released[g] = next((i for i, block in enumerate(table) if block is not null), len(table))
            self._num_cached_blocks[request.request_id] = len(tables[0])
        self._release_outside_windows(request, request.num_computed_tokens + len(hit_blocks) * self.block_size)
        per_group = needed // self.num_groups
        if per_group:
            for table in tables:
                table.extend(self.pool.allocate(per_group))
        self._set_block_ids(request)
        return True

    def _release_outside_windows(self, request: Request, computed: int) -> None:
        """Give back the blocks of the sliding groups that no coming token of `request` reads: those
        wholly before the window of the next token to compute (the one at position `computed`)."""
        tables, released = self._blocks_of[request.request_id], self._num_released[request.request_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = tables[g]
            dead = min(self._first_in_window(g, computed), len(table))
            if dead <= released[g]:
                continue
            self.pool.release([block for block in table[released[g] : dead] if block is not self.pool.null_block])
            table[released[g] : dead] = [self.pool.null_block] * (dead - released[g])
            released[g] = dead

    def _set_block_ids(self, request: Request) -> None:
        request.block_ids = [[block.block_id for block in table] for table in self._blocks_of[request.request_id]]

    def blocks_for(self, tokens: int, step_tokens: int) -> int:
        """The most blocks a request of `tokens` tokens holds, over all groups."""
        table = -(-tokens // self.block_size)
        return sum(
            table if w is None else min(table, -(-(w - 1 + step_tokens) // self.block_size) + 1) for w in self.windows
        )

    def token_capacity(self, step_tokens: int) -> int | None:
        """The longest request the pool holds alone, a whole number of blocks (None: any length, where
        every group slides and their windows fit)."""
        usable = self.pool.num_usable_blocks
        if None not in self.windows and self.blocks_for(1 << 40, step_tokens) <= usable:
            return None
        low, high = 0, usable  # (table lengths: a request holding `low` blocks per group fits)
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_for(mid * self.block_size, step_tokens) <= usable:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def num_blocks_held(self, request: Request) -> int:
        """The pool blocks `request` holds, over all groups (its tables' entries but the null block's)."""
        null = self.pool.null_block
        return sum(1 for table in self._blocks_of.get(request.request_id, ()) for b in table if b is not null)

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that its scheduled tokens now fill completely."""
        if not self.enable_caching:
            return
        tables = self._blocks_of.get(request.request_id)
        if not tables:
            return
        # (Proposed tokens being verified are computed but not the request's yet: not theirs to publish.)
        full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(tables[0]))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if full <= start:
            return
        hashes = self.block_hashes(request)
        for g, table in enumerate(tables):
            for index in range(start, full):
                if table[index] is not self.pool.null_block:
                    self.pool.cache(table[index], _key(hashes[index], g))
        self._num_cached_blocks[request.request_id] = full

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's tokens (taken for proposals it rejected); they were never
        published, since only blocks full of the request's own tokens are."""
        tables = self._blocks_of.get(request.request_id)
        keep = -(-request.num_tokens // self.block_size)
        if not tables or len(tables[0]) <= keep:
            return
        for table in tables:
            self.pool.release(list(reversed(table[keep:])))
            del table[keep:]
        self._set_block_ids(request)

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first, so a chain's later blocks are evicted before its head."""
        tables = self._blocks_of.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        # (index by index from the tail, across the groups: no group's head goes before another's tail)
        by_index = [
            block
            for index in reversed(range(len(tables[0]) if tables else 0))
            for block in (table[index] for table in tables)
        ]
        self.pool.release([block for block in by_index if block is not self.pool.null_block])
        request.block_ids = []
        if self.states is not None:
            self.states.give_back(request.request_id)
            request.state_slot = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of blocks that were cached."""
        self._num_cached_blocks = {rid: len(tables[0]) for rid, tables in self._blocks_of.items()}
        if self.snapshots is not None:
            self.snapshots.reset()
        return self.pool.reset_cache()

    @property
    def num_owned_requests(self) -> int:
        return len(self._blocks_of)

    def check_integrity(self) -> None:
        """The pool's invariants, and the state pool's: every slot held by a request that holds blocks."""
        self.pool.check_integrity()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
        if self.states is not None:
            self.states.check_integrity()
            missing = [rid for rid in self._blocks_of if self.states.slot_of(rid) is None]
            assert not missing, f"requests without a state slot: {missing}"


def _key(block_hash: bytes, group: int) -> bytes:
    """A block's prefix-cache key: its content hash, and for every group but the first, the group."""
    return block_hash if group == 0 else block_hash + bytes((group,))
