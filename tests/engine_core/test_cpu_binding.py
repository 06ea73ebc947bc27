"""engine_core/cpu_binding.py: `--cpu-threads-bind` specs to disjoint core groups, and binding a process."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.cpu_binding import assign, bind, format_groups, parse_group


def test_groups_are_read_as_vllm_spells_them():
    assert parse_group("0-3") == (0, 1, 2, 3)
    assert parse_group("0,2,4-6") == (0, 2, 4, 5, 6)
    assert assign("0-1|2,3", 2, available=range(4)) == [(0, 1), (2, 3)]
    assert assign(format_groups([(0, 1), (5,)]), 2, available=range(8)) == [(0, 1), (5,)]


@pytest.mark.parametrize(
    ("spec", "world", "error"),
    [
        ("0-3|4-7", 3, "2 group"),
        ("0-3|3-5", 2, "share CPU"),
        ("0-9", 1, "not usable"),
        ("a-b", 1, "cannot read"),
        ("3-1", 1, "bad CPU range"),
        ("0,0", 1, "twice"),
    ],
)
def test_a_spec_that_does_not_fit_is_refused(spec, world, error):
    with pytest.raises(ValueError, match=error):
        assign(spec, world, available=range(8))


def test_auto_divides_the_cores_evenly_and_none_pins_nothing():
    assert assign("auto", 1, available=range(8)) is None  # one process: torch's own default
    assert assign("none", 4, available=range(8)) is None
    groups = assign("auto", 2)  # this machine's own cores
    assert groups is not None and len(groups) == 2 and not set(groups[0]) & set(groups[1])
    assert len(groups[0]) == len(groups[1]) >= 1
    with pytest.raises(ValueError, match="cannot give"):
        assign("auto", len(os.sched_getaffinity(0)) + 1)


def test_the_engine_config_refuses_an_unreadable_spec():
    with pytest.raises(ValueError, match="cannot read"):
        EngineConfig(cpu_threads_bind="0-x")


def _bound(cores, queue) -> None:
    import torch

    bind(cores)
    queue.put((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))


def test_bind_pins_the_process_and_sets_one_torch_thread_per_core():
    cpu = min(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_bound, args=((cpu,), queue))
    child.start()
    assert queue.get(timeout=120) == ([cpu], 1)
    child.join(30)
    assert child.exitcode == 0
