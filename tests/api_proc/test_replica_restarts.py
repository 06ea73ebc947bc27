"""api_proc/replica_restarts.py: the backoff and the restart budget of data-parallel engine replicas."""

from __future__ import annotations

import pytest

from pagoda.api_proc.replica_restarts import ReplicaRestarts


def test_backoff_doubles_until_the_replica_is_over_its_restarts():
    restarts = ReplicaRestarts(2, max_restarts=3)
    assert [restarts.exited(0, 100.0) for _ in range(4)] == [1.0, 2.0, 4.0, None]
    assert restarts.down_for_good == {0} and not restarts.all_down_for_good()
    assert restarts.exited(1, 0.0) == 1.0  # each replica has its own budget


def test_restarts_are_due_after_their_delay_each_once():
    restarts = ReplicaRestarts(3, max_restarts=5)
    restarts.exited(0, 10.0)
    restarts.exited(2, 10.5)
    assert restarts.next_due() == 11.0
    assert restarts.take_due(10.9) == []
    assert restarts.take_due(11.6) == [0, 2]
    assert restarts.take_due(20.0) == [] and restarts.next_due() is None


def test_the_delay_is_capped_and_zero_restarts_means_down_for_good():
    restarts = ReplicaRestarts(1, max_restarts=10)
    delays = [restarts.exited(0, 0.0) for _ in range(10)]
    assert max(delays) == 30.0
    never = ReplicaRestarts(2, max_restarts=0)
    assert never.exited(0, 0.0) is None and never.exited(1, 0.0) is None and never.all_down_for_good()
    with pytest.raises(ValueError):
        ReplicaRestarts(1, max_restarts=-1)


def test_each_replica_gets_its_own_cores_and_gpus():
    """Replica i: the i-th core group, and on CUDA the GPUs from i x tensor_parallel_size (each of its
    ranks one more: engine_core/parallel/ranks.py ProcessRanks.rank_config)."""
    from pagoda.api_proc.engine_replicas import replica_configs
    from pagoda.engine_core.config import EngineConfig
    from pagoda.engine_core.parallel.ranks import ProcessRanks

    rank_config = ProcessRanks().rank_config

    configs = replica_configs(EngineConfig(cpu_threads_bind="0|1", device="cuda:1", tensor_parallel_size=2), 2)
    assert [c.cpu_threads_bind for c in configs] == ["0", "1"]
    assert [str(c.torch_device()) for c in configs] == ["cuda:1", "cuda:3"]
    assert [str(rank_config(configs[1], r).torch_device()) for r in (0, 1)] == ["cuda:3", "cuda:4"]
    on_cpu = replica_configs(EngineConfig(device="cpu", cpu_threads_bind="none"), 2)
    assert [str(c.torch_device()) for c in on_cpu] == ["cpu", "cpu"]
