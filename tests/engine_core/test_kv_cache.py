"""Block pool and scheduler invariants: unit checks, and hypothesis over random schedules."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.engine_core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.request import Request, RequestStatus
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.scheduler import Scheduler


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
    assert request.block_ids == [[1, 2, 3]]
    manager.free(request)
    assert [b.block_id for b in manager.pool.free_queue] == [4, 5, 3, 2, 1]


def test_blocks_are_allocated_one_at_a_time_as_decode_crosses_boundaries():
    manager = KVCacheManager(10, block_size=4)
    request = Request("r", [1, 2, 3], SamplingParams())
    assert manager.allocate_slots(request, 3) and len(request.block_ids[0]) == 1
    request.num_computed_tokens = 3
    assert manager.allocate_slots(request, 1) and len(request.block_ids[0]) == 1  # token 4 fits block 1
    request.num_computed_tokens = 4
    assert manager.allocate_slots(request, 1) and len(request.block_ids[0]) == 2  # token 5 needs block 2


def test_allocation_that_does_not_fit_takes_nothing():
    manager = KVCacheManager(4, block_size=4)
    request = Request("r", list(range(20)), SamplingParams())
    assert not manager.allocate_slots(request, 20)
    assert manager.pool.num_free_blocks == 3 and request.block_ids == []


# ---- random schedules ------------------------------------------------------------------------------

actions = st.lists(
    st.tuples(st.sampled_from(["add", "step", "abort", "reset"]), st.integers(1, 90), st.integers(1, 12)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    actions=actions,
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    alphabet=st.integers(1, 3),
    windows=st.sampled_from([(None,), (1,), (4,), (9,), (None, 4), (16, None), (None, 9, 1), (4, 4)]),
    recurrent=st.booleans(),
)
def test_random_schedules_keep_block_invariants(
    actions, num_blocks, budget, max_seqs, caching, alphabet, windows, recurrent
):
    """Drive the real scheduler and block manager with random arrivals (prompts over a tiny alphabet, so
    prefixes are shared and cached blocks get hit and evicted), steps (every scheduled request that
    completes its prompt gets a token), aborts and cache resets. A block's ref count always equals the
    number of running requests holding it, never negative; budgets hold; in every KV group (`windows`:
    full or sliding) a request's table spans its tokens, and in a sliding group it holds only the blocks
    its window and its step's tokens cover; with a recurrent group each running request holds its own state
    slot; once everything finished or was aborted every block and slot is free."""
    block_size = 4
    manager = KVCacheManager(
        num_blocks, block_size, enable_caching=caching, windows=windows, state_slots=max_seqs if recurrent else 0
    )
    capacity = manager.token_capacity(budget) or 10**6  # (as the engine sizes max_model_len; None: any length)
    scheduler = Scheduler(manager, budget, max_seqs, max_model_len=capacity)
    next_id = 0

    def step():
        out = scheduler.schedule()
        assert out.total_tokens <= budget and len(scheduler.running) <= max_seqs
        holders = Counter(b for r in scheduler.running for table in r.block_ids for b in table)
        for block in manager.pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0) >= 0
        for r in scheduler.running:
            assert len({len(table) for table in r.block_ids}) == 1 and len(r.block_ids) == len(windows)
            assert len(r.block_ids[0]) * block_size >= r.num_computed_tokens
            assert manager.num_blocks_held(r) == sum(1 for table in r.block_ids for b in table if b != 0)
            for table, window in zip(r.block_ids, windows, strict=True):
                if window is None:
                    assert 0 not in table
        for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            for table, window in zip(r.block_ids, windows, strict=True):
                if window is not None:  # (the step's first token sees keys from its position + 1 - window on)
                    assert sum(1 for b in table if b != 0) <= -(-(window - 1 + n) // block_size) + 1
        sampled = {r.request_id: [7] for r in out.requests if r.num_computed_tokens == r.num_tokens}
        scheduler.update_from_output(out, sampled)
        manager.check_integrity()
        if recurrent:
            slots = [r.state_slot for r in scheduler.running]
            assert 0 not in slots and len(set(slots)) == len(slots) == max_seqs - manager.states.num_free

    for kind, size, max_tokens in actions:
        if kind == "add":
            prompt_len = min(size, capacity - 1)
            prompt = [5 + (i * size) % alphabet for i in range(prompt_len)]
            scheduler.add_request(Request(str(next_id), prompt, SamplingParams(max_tokens=max_tokens)))
            next_id += 1
        elif kind == "step":
            step()
        elif kind == "reset":
            manager.reset_prefix_cache()
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
    assert not recurrent or manager.states.num_free == max_seqs
    assert manager.prefix_cache_hits <= manager.prefix_cache_queries
    if not caching:
        assert manager.prefix_cache_hits == 0 and not manager.pool.cached


# ---- prefix caching ----------------------------------------------------------------------------------


def _admit(manager, request):
    hits = manager.computed_blocks(request)
    request.num_computed_tokens = 0
    assert manager.allocate_slots(request, request.num_tokens - len(hits) * manager.block_size, hit_blocks=hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return len(hits)


def test_identical_prompts_share_full_blocks_and_the_last_token_is_always_computed():
    manager = KVCacheManager(20, block_size=4)
    first, second = (Request(r, list(range(8)), SamplingParams()) for r in "ab")
    assert _admit(manager, first) == 0
    assert _admit(manager, second) == 1  # 8 tokens = 2 full blocks, but the 8th token must be computed
    assert first.block_ids[0][0] == second.block_ids[0][0] and first.block_ids[0][1] != second.block_ids[0][1]
    assert manager.pool.blocks[first.block_ids[0][0]].ref_cnt == 2
    longer = Request("c", list(range(12)), SamplingParams())
    assert _admit(manager, longer) == 2 and longer.block_ids[0][:2] == first.block_ids[0]


def test_freed_cached_blocks_stay_cached_until_evicted_lru_tail_first():
    manager = KVCacheManager(7, block_size=4)  # 6 usable blocks: 1..6
    old = Request("old", list(range(12)), SamplingParams())
    _admit(manager, old)
    assert old.block_ids == [[1, 2, 3]] and len(manager.pool.cached) == 3
    manager.free(old)  # free and still cached; queued tail first behind the never-used blocks
    assert [b.block_id for b in manager.pool.free_queue] == [4, 5, 6, 3, 2, 1]
    other = Request("other", list(range(100, 116)), SamplingParams())
    _admit(manager, other)  # takes 4, 5, 6 and evicts 3, old's tail
    assert other.block_ids == [[4, 5, 6, 3]] and len(manager.pool.cached) == 2 + 4
    manager.free(other)
    again = Request("again", list(range(12)), SamplingParams())
    assert _admit(manager, again) == 2 and again.block_ids[0][:2] == [1, 2]  # the head survived


def test_cache_salt_separates_tenants():
    manager = KVCacheManager(30, block_size=4)
    prompts = {
        name: Request(name, list(range(9)), SamplingParams(), cache_salt=salt)
        for name, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None)]
    }
    hits = {name: _admit(manager, r) for name, r in prompts.items()}
    assert hits == {"a": 0, "b": 0, "c": 2, "d": 0}
    assert not set(prompts["a"].block_ids[0]) & set(prompts["b"].block_ids[0])
    assert not set(prompts["d"].block_ids[0]) & set(prompts["a"].block_ids[0])


def test_a_request_waits_for_a_sibling_prefill_then_shares_it():
    manager = KVCacheManager(40, block_size=4, watermark=0.0)
    scheduler = Scheduler(manager, 8, 8, max_model_len=100)
    for rid in ("s0", "s1", "s2"):
        scheduler.add_request(Request(rid, list(range(18)), SamplingParams(max_tokens=2)))
    first = scheduler.schedule()  # s0 takes an 8-token chunk; s1 and s2 wait for its full blocks
    assert [r.request_id for r in first.requests] == ["s0"]
    scheduler.update_from_output(first, {})
    second = scheduler.schedule()
    assert [r.request_id for r in second.requests] == ["s0"]
    scheduler.update_from_output(second, {})
    third = scheduler.schedule()  # s0's 4 full blocks are computed: the siblings share them now
    assert [r.request_id for r in third.requests] == ["s0", "s1", "s2"]
    assert third.num_scheduled_tokens == [2, 2, 2]
    s0, s1, s2 = (scheduler.requests[r] for r in ("s0", "s1", "s2"))
    assert s1.block_ids[0][:4] == s0.block_ids[0][:4] == s2.block_ids[0][:4] and s1.num_cached_tokens == 16
    assert manager.prefix_cache_hits == 32 and manager.prefix_cache_queries == 54
