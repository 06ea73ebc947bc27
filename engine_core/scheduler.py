"""Iteration-level continuous batching under a token budget.

One rule covers prefill, chunked prefill and decode: each step hands out tokens so that a request's
`num_computed_tokens` catches up with its `num_tokens`. Running requests are served first (oldest
first), then waiting ones, while the step's token budget, `max_num_seqs` and the KV pool allow. When a
running request cannot get a block, the newest running request is preempted (its blocks freed, its
progress reset) and put back at the head of the waiting queue, to be recomputed later.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.protocol import SchedulerStatsMessage
from pagoda.engine_core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What to run this step: requests in batch order and how many new tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: request id -> the proposed tokens this step verifies (scheduled after the
    # request's last token, and counted in its scheduled tokens).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Models with recurrent layers (engine_core/state_snapshots.py): (snapshot row, state slot) copies the
    # runner makes before the forward pass (requests resuming a cached prefix), and (slot, row) copies
    # after it (chunks that ended where a state is kept).
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        max_joint_prefill_tokens: int | None = None,
    ):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # A lone prefill may use the whole token budget; further prefills join a step only while the
        # step's prefill tokens stay within this. When many requests arrive at once they then get their
        # first tokens one small group after another, in arrival order, instead of all together after
        # one long step; and decodes sharing those steps are not stalled for long.
        self.max_joint_prefill_tokens = max_joint_prefill_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        # Requests whose own tokens raised while being taken in (`update_from_output`): ended, for the
        # engine to report as failed (`take_failed`).
        self.failed: list[Request] = []

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and return its blocks; idempotent."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        request.grammar = None  # its matcher's state goes now, not whenever the request is collected
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStatsMessage:
        """Queue sizes, KV-cache usage and the cumulative counters now (sent with every StepOutputs)."""
        return SchedulerStatsMessage(
            len(self.running),
            len(self.waiting),
            self.kv.pool.usage(),
            self.num_preemptions_total,
            self.kv.prefix_cache_queries,
            self.kv.prefix_cache_hits,
            state_pool_usage=self.kv.states.usage() if self.kv.states is not None else None,
        )

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self, exclude: Collection[str] = (), max_requests: int | None = None) -> SchedulerOutput:
        """Plan the next step: which requests compute how many of their tokens.

        Running requests are served first (oldest first), then waiting ones in order (preempted ones
        are at the head), while the token budget (`max_num_batched_tokens`), `max_num_seqs` and the free
        KV blocks allow; a waiting request also takes any prefix-cache hits for its first blocks. When a
        running request cannot get a block, the newest running one is preempted (listed in `preempted`,
        and not in `requests`); no request is admitted in a step that preempts.

        On return every scheduled request holds KV slots for its tokens, has its `num_computed_tokens`
        already advanced by its count (each at least 1, all together at most the budget), and has its
        newly full blocks published to the prefix cache. The caller must run exactly this batch
        (`ModelRunner.execute`), then pass the sampled tokens to `update_from_output`. An empty (falsy)
        output means nothing can run now.

        Pipeline parallel: `exclude` names the requests of steps still in flight, which are neither
        scheduled nor preempted (their K/V is still being written); at most `max_requests` requests are
        scheduled.
        """
        out = SchedulerOutput()
        if self.kv.snapshots is not None:
            self.kv.snapshots.begin_step()
        limit = max_requests if max_requests is not None else self.max_num_seqs
        budget = self._schedule_running(out, self.max_num_batched_tokens, exclude, limit)
        if not out.preempted:
            self._schedule_waiting(out, budget, limit)
        for request, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += n  # advanced now, so the next schedule plans the next chunk
            self.kv.cache_full_blocks(request)  # their K/V are written in this step, before any reader
            save = self.kv.snapshot_save(request)
            if save is not None:
                out.state_saves.append(save)
        return out

    def _with_proposals(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """How many tokens a running request computes: the rest of its prompt (or its last token), and
        when it decodes, its proposed tokens too, as many as the budget takes."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        num_new = self.kv.snapshot_cap(request, request.num_computed_tokens, num_new)
        spec = request.spec_token_ids[: budget - 1]
        if not spec or num_new != 1:
            return num_new
        out.spec_token_ids[request.request_id] = spec
        return 1 + len(spec)

    def _schedule_running(self, out: SchedulerOutput, budget: int, exclude: Collection[str], limit: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0 and len(out.requests) < limit:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or request.request_id in exclude:  # its step (or sampled token) is in flight
                index += 1
                continue
            num_new = self._with_proposals(request, budget, out)
            while not self.kv.allocate_slots(request, num_new):
                if request.request_id in out.spec_token_ids:  # no room to speculate: decode plainly
                    del out.spec_token_ids[request.request_id]
                    num_new = 1
                    continue
                # The newest running request not in flight (at worst this one).
                victim = next(r for r in reversed(self.running) if r.request_id not in exclude)
                self._preempt(victim, out)
                if victim is request:
                    return budget
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, limit: int) -> None:
        prefill_tokens = sum(n for n in out.num_scheduled_tokens if n > 1)  # partial prefills running
        prefilling = self._prefilling_heads() if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(out.requests) < limit:
            request = self.waiting[0]
            head = self.kv.head_hash(request) if request.num_computed_tokens == 0 else None
            if head is not None and head in prefilling and request.reads_prefix_cache:
                break  # a request with the same first block is being prefilled: wait, then share it
            hits = self.kv.computed_blocks(request) if request.num_computed_tokens == 0 else []
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
            num_new = self.kv.snapshot_cap(request, request.num_computed_tokens + num_hit_tokens, num_new)
            if prefill_tokens and prefill_tokens + num_new > self.max_joint_prefill_tokens:
                break
            # The free-block watermark applies only when others run: alone, a request may use it all.
            if not self.kv.allocate_slots(request, num_new, admitting=bool(self.running), hit_blocks=hits):
                break
            self.waiting.popleft()
            if hits and self.kv.snapshots is not None:
                out.state_loads.append(self.kv.snapshot_load(request, len(hits)))
            if request.num_computed_tokens == 0:
                if request.reads_prefix_cache:  # (no lookup was made for the others)
                    self.kv.record_lookup(request.num_tokens, num_hit_tokens)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit_tokens
                    request.scheduled_time = time.monotonic()
            request.num_computed_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if head is not None and self._prefilling_full_blocks(request):
                prefilling.add(head)
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            prefill_tokens += num_new

    def _prefilling_heads(self) -> set[bytes]:
        """First-block hashes of running requests that still have full prompt blocks to compute."""
        return {r.block_hashes[0] for r in self.running if r.block_hashes and self._prefilling_full_blocks(r)}

    def _prefilling_full_blocks(self, request: Request) -> bool:
        bs = self.kv.block_size
        return request.num_computed_tokens < request.num_prompt_tokens // bs * bs

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free everything, restart from token 0 later (before newer arrivals)."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        if request in out.requests:  # it was scheduled earlier in this step: undo that
            i = out.requests.index(request)
            out.requests.pop(i)
            out.num_scheduled_tokens.pop(i)
        out.spec_token_ids.pop(request.request_id, None)
        out.preempted.append(request)

    # ---- after the model ran ------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens (one, or with speculation the accepted proposals and one
        more) until one stops it; finish the requests that stop; return the finished ones. A request
        that verified proposals has K/V for its accepted tokens only: its computed count steps back to
        them, and blocks beyond its tokens go back to the pool."""
        finished = []
        for request in out.requests:
            tokens = sampled.get(request.request_id)
            if not tokens or request.status.finished:
                continue
            try:  # (what raises here comes from this request's tokens: it ends alone, see `failed`)
                status = self._take_tokens(request, tokens, request.request_id in out.spec_token_ids)
            except Exception:
                logger.exception("request %s failed while taking its sampled tokens", request.request_id)
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                self.failed.append(request)
                continue
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished

    def _take_tokens(self, request: Request, tokens: list[int], verified: bool) -> RequestStatus | None:
        """Append tokens until one stops the request; the status it stops in (None: it goes on)."""
        for token in tokens:
            request.append_token(token)
            status = request.stop_status(self.max_model_len)
            if status is not None:
                return status
        if verified:
            request.num_computed_tokens = request.num_tokens - 1
            self.kv.trim(request)
        return None

    def take_failed(self) -> list[Request]:
        """The requests `update_from_output` ended because their tokens raised, since the last call."""
        failed, self.failed = self.failed, []
        return failed
