"""Process titles: `ps -o args` shows what each process of `pagoda serve` is ("pagoda: engine_core",
"pagoda: tp worker 1", "pagoda: detok", "pagoda: api 0"), not `python -c from multiprocessing.spawn ...`,
while the short names (`ps -o comm`, pgrep, the lifecycle tests) stay "pagoda-engine", "pagoda-tp1", ..."""

from __future__ import annotations

import subprocess

import pytest

from pagoda.engine_core.lifecycle import Role
from tests.process_checks import descendants


def ps(pids: list[int], column: str) -> list[str]:
    """One `ps -o COLUMN` value per pid, as ps prints them."""
    out = subprocess.run(
        ["ps", "-o", f"{column}=", "-p", ",".join(map(str, pids))], capture_output=True, text=True, check=True
    )
    return sorted(line.strip() for line in out.stdout.splitlines())


@pytest.mark.slow
def test_ps_shows_each_childs_title_and_keeps_the_short_names(start_server):
    server = start_server("--api-workers", "2", "--tensor-parallel-size", "2")
    # (multiprocessing's resource tracker, a child of the parent too, is Python's own, not ours)
    processes = [p for p in descendants(server.process.pid) if ps([p], "args")[0].find("resource_tracker") < 0]
    assert ps(processes, "args") == [
        "pagoda: api 0",
        "pagoda: api 1",
        "pagoda: detok",
        "pagoda: engine_core",
        "pagoda: tp worker 1",
    ]
    assert ps(processes, "comm") == ["pagoda-api", "pagoda-api", "pagoda-detok", "pagoda-engine", "pagoda-tp1"]


def test_data_parallel_replicas_titles_carry_their_index():
    assert Role.ENGINE.process_title() == "pagoda: engine_core"
    assert [Role.ENGINE.process_title(i) for i in range(2)] == ["pagoda: engine_core 0", "pagoda: engine_core 1"]
    assert [Role.ENGINE.process_name(i) for i in range(2)] == ["pagoda-engine0", "pagoda-engine1"]
