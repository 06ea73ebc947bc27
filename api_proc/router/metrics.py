"""The router's Prometheus metrics, in a registry of its own (GET /metrics of `pagoda router`).

Per backend (label `backend`, its URL):
    pagoda_router_backend_requests_total     requests sent to it (each attempt, retries included)
    pagoda_router_backend_errors_total       its failures, by `kind`: connect (no connection), timeout (no
                                             byte within --read-timeout), disconnected (closed before or
                                             during the response), http_5xx (it answered 500 or more),
                                             unhealthy (its GET /health answered other than 200)
    pagoda_router_backend_in_flight          requests being sent to or answered by it now
    pagoda_router_backend_ejections_total    times it was taken out of rotation
    pagoda_router_backend_up                 1 in rotation, 0 ejected
And the router's own answers:
    pagoda_router_failed_requests_total      requests the router answered with an error of its own, by
                                             `code`: no_backend, backend_unreachable, backend_timeout,
                                             backend_failed
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ERROR_KINDS = ("connect", "timeout", "disconnected", "http_5xx", "unhealthy")
FAILURE_CODES = ("no_backend", "backend_unreachable", "backend_timeout", "backend_failed")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self, backend_urls: tuple[str, ...]):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the router process's CPU, memory and open files
        prefix = "pagoda_router_backend_"
        self.requests = Counter(
            prefix + "requests", "Requests sent to the backend", ["backend"], registry=self.registry
        )
        self.errors = Counter(prefix + "errors", "Failures of the backend", ["backend", "kind"], registry=self.registry)
        self.in_flight = Gauge(prefix + "in_flight", "Requests in flight", ["backend"], registry=self.registry)
        self.ejections = Counter(prefix + "ejections", "Times ejected", ["backend"], registry=self.registry)
        self.up = Gauge(prefix + "up", "1 in rotation, 0 ejected", ["backend"], registry=self.registry)
        self.failed = Counter(
            "pagoda_router_failed_requests",
            "Requests answered with the router's own error",
            ["code"],
            registry=self.registry,
        )
        for url in backend_urls:  # every series from the start, at 0
            self.requests.labels(url)
            self.ejections.labels(url)
            self.in_flight.labels(url)
            self.up.labels(url).set(1)
            for kind in ERROR_KINDS:
                self.errors.labels(url, kind)
        for code in FAILURE_CODES:
            self.failed.labels(code)

    def render(self) -> bytes:
        return generate_latest(self.registry)
