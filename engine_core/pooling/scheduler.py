"""Continuous batching for pooling requests: each runs its whole prompt in one step and ends there.

Every step takes waiting requests in arrival order while their prompts fit the step's token budget
(`max_num_batched_tokens`) and `max_num_seqs`; nothing is chunked (an encoder's bidirectional attention
needs the whole input at once) and no KV cache is kept, so nothing is ever preempted. The engine caps
prompts at the budget, so the oldest request always fits a step alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine_core.pooling.params import PoolingParams
from engine_core.protocol import SchedulerStatsMessage


@dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


class PoolingScheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[PoolingRequest] = deque()
        self.running: list[PoolingRequest] = []  # the step being run (empty between steps)
        self.requests: dict[str, PoolingRequest] = {}

    def add_request(self, request: PoolingRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request (a running one is already computed by the time an abort is read)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> list[PoolingRequest]:
        """The next step's requests, oldest first, whole; the caller runs them, then `finish`es them."""
        budget, now = self.max_num_batched_tokens, time.monotonic()
        while self.waiting and len(self.running) < self.max_num_seqs:
            size = len(self.waiting[0].prompt_token_ids)
            if size > budget and self.running:
                break
            request = self.waiting.popleft()
            request.scheduled_time = now
            self.running.append(request)
            budget -= size
        return self.running

    def finish(self) -> list[PoolingRequest]:
        """End the running step: its requests are done. Returns those not aborted meanwhile."""
        done = [r for r in self.running if self.requests.pop(r.request_id, None) is not None]
        self.running = []
        return done

    def stats(self) -> SchedulerStatsMessage:
        return SchedulerStatsMessage(len(self.running), len(self.waiting), 0.0, 0)
