"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, ref counts, per-request block tables.

The tensors themselves live in the model runner; this module only decides which block ids a request
owns. Block 0 is a reserved null block (a padding target for kernels and CUDA graphs) and is never
handed out.
"""

from __future__ import annotations

from engine_core.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) popleft, append and remove-from-middle.

    Allocation takes from the head, freed blocks go to the tail, so the least recently freed block is
    reused first (the order prefix caching's eviction relies on).
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All blocks, their ref counts, and the queue of free ones."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the reserved null block)")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the free queue in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Every usable block is either free with ref 0 or owned with ref > 0, never both."""
        free_ids = [b.block_id for b in self.free_queue]
        if len(free_ids) != len(set(free_ids)) or len(free_ids) != self.num_free_blocks:
            raise AssertionError("free queue holds a block twice or miscounts")
        free = set(free_ids)
        for block in self.blocks[1:]:
            if (block.block_id in free) != (block.ref_cnt == 0):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, free={block.block_id in free}")


class KVCacheManager:
    """Gives each request the blocks its tokens need, on demand, and takes them back."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Admission keeps a few blocks spare so running requests can grow without instant preemption.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._blocks_of: dict[str, list[KVCacheBlock]] = {}

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total_tokens = request.num_computed_tokens + num_new_tokens
        have = len(self._blocks_of.get(request.request_id, ()))
        return max(0, -(-total_tokens // self.block_size) - have)

    def allocate_slots(self, request: Request, num_new_tokens: int, admitting: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False (nothing taken) if they don't fit."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        reserve = self.watermark_blocks if admitting else 0
        if needed + reserve > self.pool.num_free_blocks:
            return False
        if needed:
            new_blocks = self.pool.allocate(needed)
            self._blocks_of.setdefault(request.request_id, []).extend(new_blocks)
            request.block_ids.extend(b.block_id for b in new_blocks)
        return True

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first, so a chain's later blocks are reused before its head."""
        blocks = self._blocks_of.pop(request.request_id, [])
        self.pool.release(list(reversed(blocks)))
        request.block_ids = []

    @property
    def num_owned_requests(self) -> int:
        return len(self._blocks_of)
