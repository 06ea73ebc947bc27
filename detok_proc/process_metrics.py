"""process_* metrics (CPU, memory, file descriptors, start time) of every Pagoda process, for /metrics.

The tokenizer process renders /metrics for the whole server, so it reports the standard process
metrics of each process — itself, the engine replicas and every HTTP worker — read from /proc at
scrape time (prometheus-client's ProcessCollector, which reads any pid of the same user). They keep
the standard names; the `process` ("detok", "engine", "api") and `index` (the engine replica or HTTP
worker number, as in the process titles; "0" for the tokenizer) labels tell the processes apart, so
`sum(process_resident_memory_bytes)` is the server's memory. No pid label: /metrics is public by
default and says nothing of the host beyond the server itself. A process that has exited just stops
being reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector


class ProcessesCollector(Collector):
    """The process_* families of several processes, one sample per process labelled by role and index."""

    def __init__(self) -> None:
        self._collectors: dict[int, tuple[str, int, ProcessCollector]] = {}  # by pid
        self.add(os.getpid(), "detok", 0)

    def add(self, pid: int, role: str, index: int) -> None:
        """Report `pid` from now on, labelled process=`role`, index=`index` (idempotent)."""
        if pid > 0 and pid not in self._collectors:
            self._collectors[pid] = (role, index, ProcessCollector(pid=lambda: pid, registry=None))

    def remove(self, pid: int) -> None:
        self._collectors.pop(pid, None)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for role, index, collector in list(self._collectors.values()):  # (the loop may add one meanwhile)
            for family in collector.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                labels = {"process": role, "index": str(index)}
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, **labels}, sample.value)
        return list(families.values())
