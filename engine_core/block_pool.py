"""The KV block pool: fixed-size blocks, ref counts, the free queue and the prefix cache's map.

Block 0 is a reserved null block (a padding target for kernels and CUDA graphs) and is never handed
out. The tensors themselves live in the model runner; this module only decides which block ids are
whose.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
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
        assert last is not None  # the tail sentinel always has a predecessor (the head at least)
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        before, after = block.prev_free, block.next_free
        assert before is not None and after is not None, f"block {block.block_id} is not in the free queue"
        before.next_free = after
        after.prev_free = before
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None  # the head sentinel always has a successor (the tail at least)
        if block is self._tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None  # every block between the sentinels is linked both ways
            yield block
            block = block.next_free


class BlockPool:
    """All blocks, their ref counts, the queue of free ones and the prefix cache (hash -> block).

    A cached block whose last user is gone stays cached *and* free: it sits in the free queue with its
    hash, and is evicted (its hash dropped) only when the queue hands it out again. The queue's order
    makes that least-recently-freed first, and requests free their blocks tail first, so a prefix
    chain is evicted from its end.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the reserved null block)")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}

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
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to cached blocks (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the free queue in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash; if an equal block is cached already, keep that one."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their contents); returns how many."""
        count = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return count

    def check_integrity(self) -> None:
        """Every usable block is either free with ref 0 or owned with ref > 0, never both; the cache
        map and the blocks' hashes agree."""
        free_ids = [b.block_id for b in self.free_queue]
        if len(free_ids) != len(set(free_ids)) or len(free_ids) != self.num_free_blocks:
            raise AssertionError("free queue holds a block twice or miscounts")
        free = set(free_ids)
        for block in self.blocks[1:]:
            if (block.block_id in free) != (block.ref_cnt == 0):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, free={block.block_id in free}")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} has a hash the cache does not map to it")
        if any(block.block_hash != h for h, block in self.cached.items()):
            raise AssertionError("the cache maps a hash to a block that does not carry it")
