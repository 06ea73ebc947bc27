"""detok_proc/routing.py: power of two choices, prefix affinity and SGLang's overload thresholds."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagoda.detok_proc.routing import ReplicaLoad, Router, choose_replica, overloaded

PREFIX_A, PREFIX_B = b"a" * 32, b"b" * 32


def loads(*requests: int | None) -> list[ReplicaLoad | None]:
    return [None if r is None else ReplicaLoad(r) for r in requests]


def test_of_two_replicas_the_less_loaded_one_is_picked():
    rng = random.Random(0)
    assert {choose_replica(loads(10, 3), None, rng) for _ in range(50)} == {1}
    assert {choose_replica(loads(3, 10), None, rng) for _ in range(50)} == {0}


def test_the_most_loaded_of_several_is_never_picked_and_the_rest_share():
    rng = random.Random(0)
    picks = Counter(choose_replica(loads(5, 9, 1, 5), None, rng) for _ in range(2000))
    assert picks[1] == 0  # it loses every pair it is drawn into
    assert picks[2] > picks[0] > 0 and picks[2] > picks[3] > 0  # the idlest wins most, not all
    equal = Counter(choose_replica(loads(4, 4, 4), None, rng) for _ in range(3000))
    assert min(equal.values()) > 800  # equal loads: spread evenly


def test_kv_usage_weighs_in_the_load():
    assert ReplicaLoad(4, 1.0).score == 8 and ReplicaLoad(4, 0.0).score == 4
    rng = random.Random(0)
    busy_cache, idle_cache = ReplicaLoad(6, 0.9), ReplicaLoad(8, 0.0)
    assert {choose_replica([busy_cache, idle_cache], None, rng) for _ in range(20)} == {1}


def test_replicas_that_do_not_serve_are_skipped():
    rng = random.Random(0)
    assert {choose_replica(loads(None, 50, None), None, rng) for _ in range(20)} == {1}
    assert choose_replica(loads(None, 50), 0, rng) == 1  # its prefix went to a replica that is down
    with pytest.raises(ValueError, match="no engine replica"):
        choose_replica(loads(None, None), None, rng)


def test_affinity_sticks_until_both_overload_thresholds_are_exceeded():
    rng = random.Random(0)
    assert choose_replica(loads(60, 0), 0, rng) == 0  # gap 60 <= 64
    assert choose_replica(loads(205, 140), 0, rng) == 0  # gap 65 > 64, but 205 <= 1.5 x 140 = 210
    assert choose_replica(loads(100, 30, 35), 0, rng) == 1  # gap 70 and ratio 3.3: the least loaded
    assert overloaded(100, 35) and not overloaded(64, 0) and not overloaded(150, 100)


def test_the_router_remembers_where_each_prefix_went():
    router = Router(seed=1)
    first = router.route(loads(0, 0), PREFIX_A)
    assert all(router.route(loads(0, 0), PREFIX_A) == first for _ in range(20))  # not a coin toss each time
    other = 1 - first
    spread = Counter(router.route(loads(0, 0), None) for _ in range(200))  # no prefix: both get a share
    assert min(spread.values()) > 50
    # The preferred replica overloaded: the request goes elsewhere, and the prefix follows it.
    overloaded_loads = loads(100, 0) if first == 0 else loads(0, 100)
    assert router.route(overloaded_loads, PREFIX_A) == other
    assert router.route(loads(0, 0), PREFIX_A) == other


def test_the_affinity_table_forgets_the_least_recently_routed_prefix():
    router = Router(seed=0, affinity_entries=2)
    router.route(loads(0, 0), PREFIX_A)
    router.route(loads(0, 0), PREFIX_B)
    router.route(loads(0, 0), PREFIX_A)  # A is fresh again
    router.route(loads(0, 0), b"c" * 32)
    assert list(router.affinity) == [PREFIX_A, b"c" * 32]


def test_the_same_seed_routes_the_same_way():
    def run(seed: int) -> list[int]:
        router = Router(seed=seed)
        return [router.route(loads(3, 3, 3, 3), None) for _ in range(100)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_round_robin_takes_turns_among_serving_replicas():
    router = Router("round_robin")
    assert [router.route(loads(0, 99, 0), PREFIX_A) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.route(loads(0, None, 0), PREFIX_A) for _ in range(4)] == [2, 0, 2, 0]
    with pytest.raises(ValueError):
        router.route(loads(None, None), None)
    with pytest.raises(ValueError, match="routing policy"):
        Router("least_loaded")
