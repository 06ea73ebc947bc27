"""What OpenTelemetry tracing (`--otlp-traces-endpoint`) costs a request: two servers of this checkout side
by side, one tracing to an OTLP/HTTP receiver in this process and one not, measured in the same rounds.

- one at a time: 1-token chat requests, alternating between the servers (HTTP, tokenization, one step,
  and with tracing the HTTP span plus tokenize, generate, queue, prefill, detokenize spans);
- under load: `pagoda bench serve`'s client, 16 requests of 64 prompt and 32 output tokens at once.

    python benchmarks/tracing.py               # prints each figure and the traced/plain ratio
    python benchmarks/tracing.py --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pagoda.api_proc.bench.datasets import random_requests
from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, free_port
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve


class Receiver:
    """Accepts OTLP/HTTP posts and counts the spans in them."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.spans += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def one_request(base_url: str) -> float:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1}
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - start


def under_load(base_url: str, seed: int) -> float:
    """Output tokens per second of 16 concurrent requests."""
    requests = random_requests(16, 64, 32, seed=seed)
    results, duration, _ = asyncio.run(run_serve(base_url, requests, progress=False, seed=seed))
    return summarize(results, duration)["output_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=30, help="1-token requests per server per round")
    args = parser.parse_args()
    receiver = Receiver()
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as traced_dir:
        servers = {
            "plain": PagodaServer(Path(plain_dir)),
            "traced": PagodaServer(Path(traced_dir), "--otlp-traces-endpoint", receiver.url),
        }
        try:
            latency: dict[str, list[float]] = {name: [] for name in servers}
            throughput: dict[str, list[float]] = {name: [] for name in servers}
            for server in servers.values():  # warm-up
                one_request(server.base_url)
            for round_index in range(args.rounds):
                for name, server in servers.items() if round_index % 2 == 0 else reversed(servers.items()):
                    latency[name] += [one_request(server.base_url) for _ in range(args.per_round)]
                    throughput[name].append(under_load(server.base_url, round_index))
        finally:
            for server in servers.values():
                server.stop()
    time.sleep(1)  # (the last batch of spans)
    plain_ms, traced_ms = (statistics.median(latency[n]) * 1e3 for n in ("plain", "traced"))
    plain_tps, traced_tps = (statistics.median(throughput[n]) for n in ("plain", "traced"))
    print(
        f"1-token chat, median of {len(latency['plain'])}: plain {plain_ms:.2f} ms, traced {traced_ms:.2f} ms, "
        f"ratio {traced_ms / plain_ms:.3f}"
    )
    print(
        f"16 concurrent requests, output tokens/s (median of {args.rounds}): plain {plain_tps:.1f}, "
        f"traced {traced_tps:.1f}, ratio {traced_tps / plain_tps:.3f}"
    )
    print(f"spans received: {receiver.spans}")


if __name__ == "__main__":
    main()
