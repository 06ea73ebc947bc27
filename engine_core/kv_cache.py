"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's full blocks are published in the pool's prefix cache under their chained content hash
once the scheduler has scheduled their tokens. A new request first takes the longest run of cached
blocks that matches its prompt (one more reference each, no compute) and computes only the rest;
the last prompt token is always computed, because its logits are needed.

Where every attention layer slides over the same window (Mistral, Phi-3), a request's blocks that lie
wholly before the window of its next token are given back as it grows (published ones stay cached until
evicted); the null block takes their place in its block table, which the attention kernels never read
there, so a request holds at most its window's blocks plus the ones its next step writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.engine_core.block_hash import extend_block_hashes
from pagoda.engine_core.block_pool import BlockPool, KVCacheBlock
from pagoda.engine_core.request import Request


class KVCacheManager:
    """Gives each request the blocks its tokens need, on demand, and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ):
        """`sliding_window`: the window every layer's attention shares (None: some layer sees the whole
        context, and a request keeps all its blocks)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self._num_released: dict[str, int] = {}  # leading blocks of each request given back (window left)
        # Admission keeps a few blocks spare so running requests can grow without instant preemption.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._blocks_of: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks of each request already published
        self.prefix_cache_queries = 0  # prompt tokens looked up, cumulative
        self.prefix_cache_hits = 0  # of which found cached

    def block_hashes(self, request: Request) -> list[bytes]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return request.block_hashes

    def computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks matching the start of a request that has none yet,
        leaving at least its last token to compute (none for a request that must compute them all)."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in self.block_hashes(request)[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

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
        total_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        have = len(self._blocks_of.get(request.request_id, ())) + num_hit_blocks
        return max(0, -(-total_tokens // self.block_size) - have)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, admitting: bool = False, hit_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` (after taking `hit_blocks`, cached
        blocks that hold its next tokens); False, with nothing taken, if they don't fit."""
        needed = self.num_blocks_needed(request, num_new_tokens, len(hit_blocks))
        reserve = self.watermark_blocks if admitting else 0
        hits_in_free_queue = sum(1 for b in hit_blocks if b.ref_cnt == 0)  # taking them uses free blocks
        if needed + hits_in_free_queue + reserve > self.pool.num_free_blocks:
            return False
        blocks = self._blocks_of.setdefault(request.request_id, [])
        if hit_blocks:
            self.pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        self._release_outside_window(request, request.num_computed_tokens + len(hit_blocks) * self.block_size)
        if needed:
            new_blocks = self.pool.allocate(needed)
            blocks.extend(new_blocks)
        request.block_ids = [b.block_id for b in blocks]
        return True

    def _release_outside_window(self, request: Request, computed: int) -> None:
        """Give back the blocks that no coming token of `request` reads: those wholly before the window of
        the next token to compute (position `computed` sees keys from computed + 1 - window on)."""
        if self.sliding_window is None:
            return
        blocks = self._blocks_of[request.request_id]
        dead = min((computed + 1 - self.sliding_window) // self.block_size, len(blocks))
        start = self._num_released.get(request.request_id, 0)
        if dead <= start:
            return
        self.pool.release(blocks[start:dead])
        blocks[start:dead] = [self.pool.null_block] * (dead - start)
        self._num_released[request.request_id] = dead
        request.block_ids = [b.block_id for b in blocks]

    def window_blocks(self, step_tokens: int) -> int | None:
        """The most blocks a request ever holds under the sliding window when a step computes at most
        `step_tokens` of its tokens, whatever its length (None: no window, a request holds them all)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1 + step_tokens) // self.block_size) + 1

    def num_blocks_held(self, request: Request) -> int:
        """The pool blocks `request` holds (its table's entries but the null block's)."""
        return len(self._blocks_of.get(request.request_id, ())) - self._num_released.get(request.request_id, 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that its scheduled tokens now fill completely."""
        if not self.enable_caching:
            return
        blocks = self._blocks_of.get(request.request_id, [])
        # (Proposed tokens being verified are computed but not the request's yet: not theirs to publish.)
        full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if full <= start:
            return
        hashes = self.block_hashes(request)
        for index in range(max(start, self._num_released.get(request.request_id, 0)), full):
            self.pool.cache(blocks[index], hashes[index])
        self._num_cached_blocks[request.request_id] = full

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's tokens (taken for proposals it rejected); they were never
        published, since only blocks full of the request's own tokens are."""
        blocks = self._blocks_of.get(request.request_id, [])
        keep = -(-request.num_tokens // self.block_size)
        if len(blocks) > keep:
            self.pool.release(list(reversed(blocks[keep:])))
            del blocks[keep:]
            request.block_ids = [b.block_id for b in blocks]

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first, so a chain's later blocks are evicted before its head."""
        blocks = self._blocks_of.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)  # (null blocks in their places)
        self.pool.release(list(reversed(blocks[released:])))
        request.block_ids = []

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of blocks that were cached."""
        self._num_cached_blocks = {rid: len(blocks) for rid, blocks in self._blocks_of.items()}
        return self.pool.reset_cache()

    @property
    def num_owned_requests(self) -> int:
        return len(self._blocks_of)
