"""The scheduler's decisions, step by step, on the real scheduler and block manager (no model)."""

from __future__ import annotations

from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.request import Request, RequestStatus
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=200):
    """Prefix caching off: these prompts share prefixes, and these tests are about everything else."""
    return Scheduler(
        KVCacheManager(num_blocks, block_size, watermark=0.0, enable_caching=False), budget, max_seqs, max_model_len
    )


def request(rid, prompt_len, max_tokens=4, **kw):
    return Request(
        rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=frozenset({2})
    )


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    sampled = {r.request_id: [token] for r in out.requests if r.num_computed_tokens == r.num_tokens}
    finished = scheduler.update_from_output(out, sampled)
    return out, finished


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    s = make(budget=10)
    s.add_request(request("a", 3))
    run_step(s)  # a prefilled, got its first token
    s.add_request(request("b", 25))
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 9]  # a decodes, b gets the rest of the budget
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == [1, 9]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == [1, 7]  # b's last chunk; it samples its first token now
    assert s.requests["b"].num_output_tokens == 1


def test_finished_request_frees_blocks_and_waiting_starts_next_step():
    s = make(max_seqs=1)
    s.add_request(request("a", 4, max_tokens=2))
    s.add_request(request("b", 4, max_tokens=2))
    run_step(s)
    _, finished = run_step(s)
    assert [r.request_id for r in finished] == ["a"] and finished[0].finish_reason == "length"
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["b"]


def test_stop_conditions():
    s = make()
    s.add_request(request("eos", 4, max_tokens=10))
    s.add_request(request("min", 4, max_tokens=10, min_tokens=3))
    s.add_request(request("ignore", 4, max_tokens=3, ignore_eos=True))
    s.add_request(request("stopid", 4, max_tokens=10, stop_token_ids=[9], ignore_eos=True))
    _, finished = run_step(s, token=2)
    assert {r.request_id for r in finished} == {"eos"}
    assert finished[0].status == RequestStatus.FINISHED_STOPPED
    run_step(s, token=2)
    _, finished = run_step(s, token=2)  # third token: min_tokens reached, ignore_eos hits max_tokens
    assert {r.request_id: r.finish_reason for r in finished} == {"min": "stop", "ignore": "length"}
    _, finished = run_step(s, token=9)
    assert [r.request_id for r in finished] == ["stopid"]


def test_max_model_len_ends_request():
    s = make(max_model_len=12)
    s.add_request(request("a", 10, max_tokens=100))
    run_step(s)
    _, finished = run_step(s)
    assert finished and finished[0].num_tokens == 12 and finished[0].finish_reason == "length"


def test_preemption_newest_first_and_resume():
    s = make(num_blocks=7, block_size=4, budget=64, max_model_len=24)  # 6 usable blocks = 24 tokens
    s.add_request(request("old", 8, max_tokens=12))
    s.add_request(request("new", 8, max_tokens=12))
    run_step(s)  # both prefilled: 2 blocks each, 2 free
    preempted = []
    for _ in range(10):
        out, _ = run_step(s)
        preempted += [r.request_id for r in out.preempted]
        if preempted:
            break
    assert preempted == ["new"]
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == [] and new.num_computed_tokens == 0
    assert s.waiting[0] is new  # back at the head of the queue
    for _ in range(20):
        if "old" not in s.requests:
            break
        run_step(s)
    tokens_so_far = new.num_tokens
    out, _ = run_step(s)
    assert out.requests == [new] and out.num_scheduled_tokens == [tokens_so_far]  # recomputes everything


def test_abort_in_every_state():
    s = make(budget=4)
    s.add_request(request("running", 3))
    s.add_request(request("partial", 12))
    s.add_request(request("waiting", 3))
    s.schedule()  # running prefilled (3) + 1 token of partial; waiting waits
    for rid in ("running", "partial", "waiting"):
        assert s.abort(rid).status == RequestStatus.FINISHED_ABORTED
    assert s.abort("running") is None  # idempotent
    assert not s.has_unfinished() and s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks


def test_max_num_seqs_and_token_budget():
    s = make(budget=10, max_seqs=2)
    for i in range(4):
        s.add_request(request(str(i), 3))
    out = s.schedule()
    assert len(out.requests) == 2 and out.total_tokens == 6


def test_joint_prefill_limit_groups_a_burst_in_arrival_order_but_not_a_lone_prompt():
    s = Scheduler(KVCacheManager(256, 4, watermark=0.0, enable_caching=False), 64, 16, 200, max_joint_prefill_tokens=16)
    s.add_request(request("long", 40))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == [40]  # alone: the whole prompt in one step, past the joint limit
    for i in range(5):
        s.add_request(request(f"r{i}", 8))
    steps = [[r.request_id for r in run_step(s)[0].requests] for _ in range(3)]
    # "long" decodes every step; the burst joins two prompts (16 prefill tokens) at a time, in order
    assert steps == [["long", "r0", "r1"], ["long", "r0", "r1", "r2", "r3"], ["long", "r0", "r1", "r2", "r3", "r4"]]


def test_pipelined_steps_skip_and_never_preempt_requests_in_flight():
    """Pipeline parallel: requests whose step is in flight (`exclude`) are neither scheduled (not even a
    prefill's next chunk) nor preempted, and a step takes at most `max_requests`."""
    s = make(budget=6)
    s.add_request(request("long", 20))
    s.add_request(request("a", 2))
    s.add_request(request("b", 2))
    first = s.schedule(max_requests=1)
    assert [r.request_id for r in first.requests] == ["long"] and first.num_scheduled_tokens == [6]
    second = s.schedule(exclude={"long"}, max_requests=2)
    assert [r.request_id for r in second.requests] == ["a", "b"]  # not long's next chunk
    assert s.schedule(exclude={"long", "a", "b"}).requests == []

    s = make(num_blocks=7, block_size=4, budget=64, max_model_len=24)  # 6 usable blocks = 24 tokens
    s.add_request(request("old", 8, max_tokens=12))
    s.add_request(request("new", 8, max_tokens=12))
    run_step(s)  # both prefilled: 2 blocks each, 2 free
    preempted = []
    for _ in range(10):  # "new" (the one preempted without pipelining) is always in flight
        out = s.schedule(exclude={"new"})
        preempted += [r.request_id for r in out.preempted]
        s.update_from_output(out, {r.request_id: [7] for r in out.requests})
        if preempted:
            break
    assert preempted == ["old"]  # the newest running request not in flight: "old" itself
