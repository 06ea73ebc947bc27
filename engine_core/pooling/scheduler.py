"""Continuous batching for pooling requests: each runs its whole prompt in one step and ends there.

Every step fills the token budget (`max_num_batched_tokens`) and `max_num_seqs` with whole prompts;
nothing is chunked (an encoder's bidirectional attention needs the whole input at once) and no KV cache
is kept, so nothing is ever preempted.

The inputs of one client request (`PoolingParams.batch_id`) form a batch; a request without one is a
batch of its own. Batches take turns, one input each, least recently served first (a new batch joins
the end of the turn): a one-sentence request that arrives while a 2,048-input batch runs joins the next
step beside that batch's next inputs instead of waiting for all of them. A batch whose next input does
not fit what is left of the budget sits out the rest of the step, and is then the least recently
served: it leads the next step, where it fits alone (the engine caps prompts at the budget), so no
input waits forever.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.protocol import SchedulerStatsMessage


@dataclass(eq=False)  # (compared by identity: aborting one of a batch's thousands of inputs scans its queue)
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None

    @property
    def batch(self) -> str:
        """The client request this input belongs to (its own id when it came alone)."""
        return self.params.batch_id or self.request_id

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


class PoolingScheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # batch -> its waiting inputs in arrival order; batches least recently served first
        self.waiting: OrderedDict[str, deque[PoolingRequest]] = OrderedDict()
        self.running: list[PoolingRequest] = []  # the step being run (empty between steps)
        self.requests: dict[str, PoolingRequest] = {}

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    def add_request(self, request: PoolingRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.setdefault(request.batch, deque()).append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request (a running one is already computed by the time an abort is read)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        queue = self.waiting.get(request.batch)
        if queue is not None and request in queue:
            queue.remove(request)
            if not queue:
                del self.waiting[request.batch]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> list[PoolingRequest]:
        """The next step's requests, whole, one per batch in turn (module docstring); the caller runs
        them, then `finish`es them."""
        budget, now = self.max_num_batched_tokens, time.monotonic()
        turns = deque(self.waiting)
        while turns and len(self.running) < self.max_num_seqs:
            batch = turns.popleft()
            queue = self.waiting[batch]
            size = len(queue[0].prompt_token_ids)
            if size > budget and self.running:
                continue  # (sits out the step: being now the least recently served, it leads the next)
            request = queue.popleft()
            request.scheduled_time = now
            self.running.append(request)
            budget -= size
            if queue:
                self.waiting.move_to_end(batch)
                turns.append(batch)
            else:
                del self.waiting[batch]
        return self.running

    def finish(self) -> list[PoolingRequest]:
        """End the running step: its requests are done. Returns those not aborted meanwhile."""
        done = [r for r in self.running if self.requests.pop(r.request_id, None) is not None]
        self.running = []
        return done

    def stats(self) -> SchedulerStatsMessage:
        return SchedulerStatsMessage(len(self.running), self.num_waiting, 0.0, 0)
