"""GET /metrics of a running test server, parsed: the values of its samples, and waiting for a condition on
them (what a disconnect or an abort sets off arrives asynchronously)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagoda.api_proc.bench.local_server import PagodaServer, wait_until


class Scrape:
    """One GET /metrics, parsed."""

    def __init__(self, server: PagodaServer):
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
            self.content_type = response.headers["Content-Type"]
            text = response.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels`."""
        return sum(
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def scrape_until(server: PagodaServer, condition, timeout: float = 60.0) -> Scrape:
    """Scrape until `condition(scrape)` holds (what a disconnect sets off arrives asynchronously); the last
    scrape (the caller asserts what it needs of it)."""
    last: list[Scrape] = []

    def holds() -> bool:
        last[:] = [Scrape(server)]
        return condition(last[0])

    wait_until(holds, timeout, 0.1)
    return last[0]
