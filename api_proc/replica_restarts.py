"""When a data-parallel engine replica that died is started again (`--max-replica-restarts`).

A replica's process that exits while the server runs (killed, crashed, or killed by the launcher after
the tokenizer process saw its loop stall) is restarted after a backoff of 1, 2, 4, ... seconds (at
most 30), up to `max_restarts` times over the server's life; after that it stays down and the others
serve alone. Only when every replica is down for good does the server give up (exit 1). With a single
engine there is nothing to fall back on while it restarts: the server exits at once, as it always has,
so that its supervisor (systemd, Kubernetes) restarts all of it.
"""

from __future__ import annotations

_FIRST_DELAY_S = 1.0
_MAX_DELAY_S = 30.0


class ReplicaRestarts:
    def __init__(self, num_replicas: int, max_restarts: int):
        if max_restarts < 0:
            raise ValueError("--max-replica-restarts must be 0 or more")
        self.max_restarts = max_restarts
        self.restarts = [0] * num_replicas  # restarts so far, per replica
        self.due: dict[int, float] = {}  # replica -> time.monotonic() of its restart
        self.down_for_good: set[int] = set()

    def exited(self, index: int, now: float) -> float | None:
        """Replica `index` has exited at `now`: the seconds until its restart, or None (over its restarts)."""
        if self.restarts[index] >= self.max_restarts:
            self.down_for_good.add(index)
            return None
        self.restarts[index] += 1
        delay = min(_MAX_DELAY_S, _FIRST_DELAY_S * 2 ** (self.restarts[index] - 1))
        self.due[index] = now + delay
        return delay

    def next_due(self) -> float | None:
        """When the next restart is due (None: none scheduled)."""
        return min(self.due.values(), default=None)

    def take_due(self, now: float) -> list[int]:
        """The replicas whose restart is due by `now` (each returned once)."""
        ready = sorted(index for index, at in self.due.items() if at <= now)
        for index in ready:
            del self.due[index]
        return ready

    def all_down_for_good(self) -> bool:
        return len(self.down_for_good) == len(self.restarts)
