"""Block pool and scheduler invariants: unit checks, and hypothesis over random schedules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and queue.num_free == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]


def test_null_block_never_allocated_and_free_is_tail_first():
    pool = BlockPool(6)
    taken = pool.allocate(5)
    assert 0 not in [b.block_id for b in taken] and pool.num_free_blocks == 0
    manager = KVCacheManager(6, block_size=4)
    request = Request("r", list(range(10)), SamplingParams())
    assert manager.allocate_slots(request, 10)
    assert request.block_ids == [1, 2, 3]
    manager.free(request)
    assert [b.block_id for b in manager.pool.free_queue] == [4, 5, 3, 2, 1]


def test_blocks_are_allocated_one_at_a_time_as_decode_crosses_boundaries():
    manager = KVCacheManager(10, block_size=4)
    request = Request("r", [1, 2, 3], SamplingParams())
    assert manager.allocate_slots(request, 3) and len(request.block_ids) == 1
    request.num_computed_tokens = 3
    assert manager.allocate_slots(request, 1) and len(request.block_ids) == 1  # token 4 fits block 1
    request.num_computed_tokens = 4
    assert manager.allocate_slots(request, 1) and len(request.block_ids) == 2  # token 5 needs block 2


def test_allocation_that_does_not_fit_takes_nothing():
    manager = KVCacheManager(4, block_size=4)
    request = Request("r", list(range(20)), SamplingParams())
    assert not manager.allocate_slots(request, 20)
    assert manager.pool.num_free_blocks == 3 and request.block_ids == []


# ---- random schedules ------------------------------------------------------------------------------

actions = st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 90), st.integers(1, 12)),
                   min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(actions=actions, num_blocks=st.integers(8, 40), budget=st.integers(1, 64), max_seqs=st.integers(1, 6))
def test_random_schedules_keep_block_invariants(actions, num_blocks, budget, max_seqs):
    """Drive the real scheduler and block manager with random arrivals, steps (every scheduled request
    that completes its prompt gets a token) and aborts. No block is ever owned twice, ref counts stay
    consistent, budgets hold, and once everything finished or was aborted every block is free."""
    block_size = 4
    manager = KVCacheManager(num_blocks, block_size)
    capacity = manager.pool.num_usable_blocks * block_size
    scheduler = Scheduler(manager, budget, max_seqs, max_model_len=capacity)
    next_id = 0

    def step():
        out = scheduler.schedule()
        assert out.total_tokens <= budget and len(scheduler.running) <= max_seqs
        owned = [b for r in scheduler.running for b in r.block_ids]
        assert len(owned) == len(set(owned)) and 0 not in owned
        for r in scheduler.running:
            assert len(r.block_ids) * block_size >= r.num_computed_tokens
        sampled = {r.request_id: 7 for r in out.requests if r.num_computed_tokens == r.num_tokens}
        scheduler.update_from_output(out, sampled)
        manager.pool.check_integrity()

    for kind, size, max_tokens in actions:
        if kind == "add":
            prompt_len = min(size, capacity - 1)
            scheduler.add_request(Request(str(next_id), [5] * prompt_len, SamplingParams(max_tokens=max_tokens)))
            next_id += 1
        elif kind == "step":
            step()
        elif scheduler.requests:
            victim = sorted(scheduler.requests)[size % len(scheduler.requests)]
            assert scheduler.abort(victim).status == RequestStatus.FINISHED_ABORTED
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        step()
    assert not scheduler.has_unfinished(), "scheduler stopped making progress"
    assert manager.pool.num_free_blocks == manager.pool.num_usable_blocks
    assert manager.num_owned_requests == 0
