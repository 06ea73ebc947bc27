"""What `pagoda router` costs and what P2C buys, each against its baseline in the same run.

1. Added latency: 1-token requests one at a time over keep-alive connections, alternating between the
   backend directly and the router in front of it; the medians' difference. Twice: against the null SSE
   server (api_proc/bench/null_server.py: the router's own cost, nothing else moves) and against a real
   `pagoda serve` of the default model (the issue's "1-token request"). Target: median added <= 1 ms.
2. SSE relay rate: 256 concurrent streams of 400 chunks each from the null server, read by one
   `pagoda bench` client (benchmarks/sse_rate.py's run), directly and through the router: chunks/s. The
   null server writes 16 events per write as a busy server's socket would carry them, and once more 1 per
   write (every event its own read and write in the router). Target: >= 50,000 chunks/s through the router.
3. Skewed load: three null servers of fixed capacity (4 requests at once each, the rest queue), one at
   half speed (80 ms to the first token instead of 40); Poisson arrivals at 80 % of the three's total
   capacity, through a router with --policy p2c and one with round_robin, the same arrivals for both:
   p99 TTFT side by side. Round robin gives the slow one a third of the load, more than it can serve.
   Target: P2C's p99 <= 0.5x round robin's.

The router runs as its own process (`pagoda router`); the null servers and the client share this one.

    python benchmarks/router.py                 # everything (~2 minutes on 2 cores)
    python benchmarks/router.py --skip-model    # without the real-model latency (no model load)
    python benchmarks/router.py --only relay
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from pagoda.api_proc.bench.datasets import random_requests
from pagoda.api_proc.bench.local_router import LocalRouter
from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, cpu_seconds, free_port
from pagoda.api_proc.bench.local_server import http as http_request
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.null_server import NullServer
from pagoda.api_proc.bench.runner import run_serve

SLOTS = 4  # requests each skew backend serves at once
FAST_S, SLOW_S = 0.040, 0.080  # seconds to the first token


def _connection(base_url: str) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)


def _one(conn: http.client.HTTPConnection, body: bytes) -> float:
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    elapsed = time.perf_counter() - start
    assert response.status == 200, response.status
    return elapsed


def added_latency(backend_url: str, router_url: str, body: dict, rounds: int) -> tuple[float, float, float]:
    """(median direct, median through the router, median of the differences within each pair) in ms, the
    requests alternating between the two paths; the paired one is the steadier when the machine's load
    drifts during the run."""
    data = json.dumps(body).encode()
    direct, routed = _connection(backend_url), _connection(router_url)
    for _ in range(5):  # warm both paths (connections, caches)
        _one(direct, data)
        _one(routed, data)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds):
        order = ((direct, times[0]), (routed, times[1]))
        for conn, out in order if i % 2 == 0 else reversed(order):
            out.append(_one(conn, data))
    direct.close()
    routed.close()
    paired = [b - a for a, b in zip(*times, strict=True)]
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3, statistics.median(paired) * 1e3


def _measured(router: LocalRouter, backend_url: str, body: dict, rounds: int) -> str:
    """The latency line of one backend: medians, the added time, and the router's CPU time per request
    (from /proc: what the router itself costs, whatever else the machine is doing)."""
    cpu = cpu_seconds(router.process.pid)
    direct, routed, paired = added_latency(backend_url, router.base_url, body, rounds)
    per_request = (cpu_seconds(router.process.pid) - cpu) / (rounds + 5)
    return (
        f"direct {direct:7.3f} ms   router {routed:7.3f} ms   added {routed - direct:+.3f} ms "
        f"(paired {paired:+.3f} ms; target <= 1 ms); router CPU {per_request * 1e3:.3f} ms per request"
    )


def latency(workdir: Path, rounds: int, with_model: bool) -> None:
    print("== added latency, 1-token requests (medians) ==")
    null = NullServer(free_port())
    router = LocalRouter(workdir, [null.url])
    try:
        print("null server   " + _measured(router, null.url, {"prompt": "x", "max_tokens": 1}, rounds))
    finally:
        router.stop()
        null.stop()
    if not with_model:
        return
    (workdir / "serve").mkdir()
    server = PagodaServer(workdir / "serve")
    router = LocalRouter(workdir, [server.base_url])
    try:
        body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
        print("pagoda serve  " + _measured(router, server.base_url, body, rounds))
    finally:
        router.stop()
        server.stop()


def _chunks_per_second(url: str) -> float:
    requests = random_requests(256, 4, 400, seed=0)
    start = time.perf_counter()
    results, _, _ = asyncio.run(run_serve(url, requests, progress=False))
    wall = time.perf_counter() - start
    chunks = sum(len(r.chunk_times) for r in results)
    assert chunks == 256 * 400, [r.error for r in results if r.error][:3]
    return chunks / wall


def relay(workdir: Path) -> None:
    print("== SSE relay: 256 streams x 400 chunks ==")
    for per_write in (16, 1):
        null = NullServer(free_port(), chunks_per_write=per_write)
        router = LocalRouter(workdir, [null.url])
        try:
            direct = _chunks_per_second(null.url)
            routed = _chunks_per_second(router.base_url)
        finally:
            router.stop()
            null.stop()
        print(
            f"{per_write:2d} events/write  direct {direct:9,.0f} chunks/s   router {routed:9,.0f} chunks/s   "
            f"({routed / direct:.2f}x direct; {routed / 50000:.2f}x the 50,000/s target)"
        )


def skew(workdir: Path, num_requests: int) -> None:
    capacity = 2 * SLOTS / FAST_S + SLOTS / SLOW_S  # requests/s the three serve together
    rate = 0.8 * capacity
    print(f"== skewed load: 2 backends at {FAST_S * 1e3:.0f} ms, 1 at {SLOW_S * 1e3:.0f} ms, {SLOTS} slots each; ")
    print(f"   {num_requests} requests, Poisson at {rate:.0f}/s = 80 % of their {capacity:.0f}/s ==")
    servers = [NullServer(free_port(), FAST_S, SLOTS), NullServer(free_port(), FAST_S, SLOTS)]
    servers.append(NullServer(free_port(), SLOW_S, SLOTS))
    urls = [s.url for s in servers]
    p99 = {}
    try:
        for policy in ("round_robin", "p2c"):
            router = LocalRouter(workdir, urls, "--policy", policy, "--seed", "0")
            try:
                requests = random_requests(num_requests, 4, 8, seed=1)
                results, duration, _ = asyncio.run(
                    run_serve(router.base_url, requests, request_rate=rate, seed=2, progress=False)
                )
                metrics = http_request("GET", router.base_url + "/metrics")[1]
            finally:
                router.stop()
            summary = summarize(results, duration)
            assert summary["failed"] == 0, [r.error for r in results if r.error][:3]
            share = _share(str(metrics), urls[2]) / num_requests
            ttft = summary["ttft_ms"]
            p99[policy] = ttft["p99"]
            print(
                f"{policy:12s} TTFT median {ttft['median']:8.1f} ms   p99 {ttft['p99']:8.1f} ms"
                f"   slow backend's share {share:.1%}"
            )
    finally:
        for server in servers:
            server.stop()
    print(f"P2C p99 / round robin p99 = {p99['p2c'] / p99['round_robin']:.3f} (target <= 0.5)")


def _share(metrics_text: str, url: str) -> float:
    """The requests the router sent to `url`, read from its /metrics text."""
    for line in metrics_text.splitlines():
        if line.startswith(f'pagoda_router_backend_requests_total{{backend="{url}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["latency", "relay", "skew"], default=None)
    parser.add_argument("--rounds", type=int, default=400, help="requests per path in the latency runs")
    parser.add_argument("--skew-requests", type=int, default=1500)
    parser.add_argument("--skip-model", action="store_true", help="no latency run against the real model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagoda-router-bench-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "latency"):
            latency(workdir, args.rounds, not args.skip_model)
        if args.only in (None, "relay"):
            relay(workdir)
        if args.only in (None, "skew"):
            skew(workdir, args.skew_requests)


if __name__ == "__main__":
    main()
