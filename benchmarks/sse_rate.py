"""Is the benchmark client ever the bottleneck? Streamed chunks parsed per second by one `pagoda bench`
client process: 256 concurrent streams from a null server that emits tokens as fast as it can.
Target: >= 20,000 chunks/s on the 2-core development machine.

    python benchmarks/sse_rate.py
"""

from __future__ import annotations

import asyncio
import time

from pagoda.api_proc.bench.datasets import random_requests
from pagoda.api_proc.bench.local_server import free_port
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.null_server import NullServer
from pagoda.api_proc.bench.runner import run_serve


def main() -> None:
    server = NullServer(free_port())
    try:
        requests = random_requests(256, 4, 400, seed=0)
        start = time.perf_counter()
        results, duration, _ = asyncio.run(run_serve(server.url, requests, progress=False))
        wall = time.perf_counter() - start
    finally:
        server.stop()
    chunks = sum(len(r.chunk_times) for r in results)
    summary = summarize(results, duration)
    assert summary["completed"] == 256 and chunks == 256 * 400
    print(
        f"{chunks} chunks over 256 concurrent streams in {wall:.2f} s: {chunks / wall:,.0f} chunks/s "
        f"({chunks / wall / 20000:.2f}x the 20,000/s target; the null server shares the same 2 cores)"
    )


if __name__ == "__main__":
    main()
