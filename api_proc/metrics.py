"""GET /metrics, and the counters only the HTTP layer knows.

Every metric is rendered by the tokenizer process (detok_proc/metrics.py), which sees every step's
stats and every request: /metrics asks it for the text over the frontend socket (MetricsQuery), so
each worker answers with the whole server's metrics. What only an HTTP worker knows — requests
refused with 429/413, ended by a client disconnect, or ended by the request timeout — it counts here
and sends to the tokenizer process as a cumulative `ApiWorkerStats` snapshot at start-up and whenever
a count changes; that process sums the workers (and reports each worker's process_* metrics, labelled
by its worker number).
Snapshots rather than increments: a repeated or reordered message cannot count anything twice.

The API for the rest of the HTTP layer (one worker per process, so the counts are module state):

    count_rejected(status)  a request refused with 429 (at capacity) or 413 (body too large)
    count_timed_out()       a request ended by the server's request timeout
    count_aborted()         a request whose client disconnected (api_proc/request_log.py counts it)
    set_worker(worker)      this process is HTTP worker number `worker` (api_proc/worker.py, at start)
"""

from __future__ import annotations

import os
from collections import Counter

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagoda.api_proc.client import AsyncEngineClient
from pagoda.engine_core import protocol

_rejected: Counter[int] = Counter()
_counts = {"aborted": 0, "timed_out": 0}
_client: AsyncEngineClient | None = None  # where the snapshots go; set by install()
_worker = 0  # this process's number among the HTTP workers; set by set_worker()


def set_worker(worker: int) -> None:
    """This process is HTTP worker number `worker`: its snapshots say so."""
    global _worker
    _worker = worker


def count_rejected(status: int) -> None:
    """Count a request refused with HTTP `status` (429 or 413) before any work was done for it."""
    _rejected[status] += 1
    _report()


def count_timed_out() -> None:
    """Count a request ended by the server's request timeout (its engine work is aborted)."""
    _counts["timed_out"] += 1
    _report()


def count_aborted() -> None:
    """Count a request whose client went away before the response was complete."""
    _counts["aborted"] += 1
    _report()


def snapshot() -> protocol.ApiWorkerStats:
    return protocol.ApiWorkerStats(
        pid=os.getpid(),
        worker=_worker,
        rejected=dict(_rejected),
        aborted=_counts["aborted"],
        timed_out=_counts["timed_out"],
    )


def _report() -> None:
    if _client is not None:
        _client.post(snapshot())


def install(app: web.Application, client: AsyncEngineClient) -> None:
    """Add GET /metrics to `app`; this worker's snapshots go through `client`."""
    global _client
    _client = client

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=await client.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def announce(app: web.Application) -> None:  # so this worker's process metrics show from the start
        _report()

    app.router.add_get("/metrics", metrics)
    app.on_startup.append(announce)
