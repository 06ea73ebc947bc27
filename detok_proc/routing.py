"""Which engine replica a request goes to, under data parallelism (`--data-parallel-size`).

`p2c` (the default): **power of two choices** over a load score, with **prefix affinity**.
- Load: a replica's queued and running requests, from the scheduler stats it sends with every step,
  plus the requests sent to it since those stats (so that a burst arriving between two steps does not
  all pick the replica that looked idlest), scaled up by its KV-cache usage: a replica whose pool is
  full counts double, since what it is sent next waits for blocks.
- Affinity: a request whose first full KV block (its hash, cache salt included) was last sent to a
  replica goes there too, where its prefix is cached; the `n` samples of one request are one routing
  decision. Unless that replica is overloaded, with SGLang's thresholds: its load exceeds the least
  loaded replica's by more than 64 requests and by more than 1.5 times; then the least loaded replica.
- Otherwise two distinct replicas are drawn at random and the less loaded one wins: nearly the balance
  of always picking the least loaded, without every frontend herding onto the same one.
`round_robin`: replicas in turn, ignoring load and prefixes (the baseline of benchmarks/parallel.py).

`choose_replica` is the decision, a pure function; `Router` holds its state (the random generator,
seeded so tests are reproducible, the affinity table and the round-robin position).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("p2c", "round_robin")
BALANCE_ABS_THRESHOLD = 64  # SGLang's router defaults (balance_abs_threshold, balance_rel_threshold)
BALANCE_REL_THRESHOLD = 1.5
AFFINITY_ENTRIES = 65536  # prefixes remembered, least recently routed forgotten first


@dataclass(frozen=True)
class ReplicaLoad:
    requests: int  # waiting + running in its latest stats, plus those sent to it since
    kv_cache_usage: float = 0.0  # 0..1

    @property
    def score(self) -> float:
        return self.requests * (1.0 + self.kv_cache_usage)


def overloaded(load: float, least: float) -> bool:
    """SGLang's imbalance test: both thresholds exceeded."""
    return load - least > BALANCE_ABS_THRESHOLD and load > least * BALANCE_REL_THRESHOLD


def choose_replica(loads: Sequence[ReplicaLoad | None], preferred: int | None, rng: random.Random) -> int:
    """The replica for one request. `loads[i]` is None for a replica that is not serving; `preferred` is
    where its prefix was last sent (or None). Raises ValueError when no replica serves."""
    serving = [i for i, load in enumerate(loads) if load is not None]
    if not serving:
        raise ValueError("no engine replica is serving")
    scores = {i: loads[i].score for i in serving}  # type: ignore[union-attr]
    if preferred in scores:
        least = min(serving, key=scores.__getitem__)
        return least if overloaded(scores[preferred], scores[least]) else preferred
    if len(serving) == 1:
        return serving[0]
    first, second = rng.sample(serving, 2)
    return first if scores[first] <= scores[second] else second


class Router:
    def __init__(self, policy: str = "p2c", seed: int = 0, affinity_entries: int = AFFINITY_ENTRIES):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self.rng = random.Random(seed)
        self.affinity: OrderedDict[bytes, int] = OrderedDict()  # first block hash -> replica last sent to
        self.affinity_entries = affinity_entries
        self._next = 0  # round robin: the replica to try first

    def route(self, loads: Sequence[ReplicaLoad | None], prefix: bytes | None) -> int:
        """The replica for a request whose first full block hashes to `prefix` (None: shorter than a
        block); remembers the choice for the next request with that prefix."""
        if self.policy == "round_robin":
            return self._round_robin(loads)
        choice = choose_replica(loads, None if prefix is None else self.affinity.get(prefix), self.rng)
        if prefix is not None:
            self.affinity[prefix] = choice
            self.affinity.move_to_end(prefix)
            if len(self.affinity) > self.affinity_entries:
                self.affinity.popitem(last=False)
        return choice

    def _round_robin(self, loads: Sequence[ReplicaLoad | None]) -> int:
        for offset in range(len(loads)):
            index = (self._next + offset) % len(loads)
            if loads[index] is not None:
                self._next = index + 1
                return index
        raise ValueError("no engine replica is serving")
