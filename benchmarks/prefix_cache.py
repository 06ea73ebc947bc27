"""Prefix caching: the same workload against a server with caching on and one with it off, same run.

32 requests share a 1,024-token prefix and add 32 unique tokens each; 32 output tokens (ignore_eos),
8 at a time, streamed over HTTP. vLLM's CPU build, same workload over HTTP on this machine kind
(../shared/anchors/peers-cpu.md): median TTFT 1.09 s with caching, 10.9 s without.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from pagoda.api_proc.bench.datasets import prefix_requests
from pagoda.api_proc.bench.local_server import PagodaServer, http
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve

VLLM_TTFT_P50_MS = {True: 1091, False: 10893}


def measure(caching: bool) -> dict:
    args = [] if caching else ["--no-prefix-caching"]
    server = PagodaServer(Path(tempfile.mkdtemp(prefix="pagoda-bench-")), *args, remove_dir_on_stop=True)
    try:
        http("POST", server.base_url + "/v1/completions", {"prompt": [5] * 8, "max_tokens": 2})
        requests = prefix_requests(32, 1024, 32, 32, seed=0)
        results, duration, _ = asyncio.run(run_serve(server.base_url, requests, max_concurrency=8, progress=False))
        summary = summarize(results, duration)
        assert summary["failed"] == 0, summary
        return {
            "ttft_p50": summary["ttft_ms"]["median"],
            "ttft_mean": summary["ttft_ms"]["mean"],
            "total_tok_s": summary["total_throughput"],
            "output_tok_s": summary["output_throughput"],
        }
    finally:
        server.stop()


def main() -> None:
    on, off = measure(True), measure(False)
    print("\nPrefix caching: 32 x (1024 shared + 32 unique) -> 32 tokens, concurrency 8, over HTTP")
    print(f"  {'':28} {'caching on':>12} {'caching off':>12} {'on / off':>9}")
    for key, label in [
        ("ttft_p50", "TTFT p50 ms"),
        ("ttft_mean", "TTFT mean ms"),
        ("total_tok_s", "total tok/s (in + out)"),
        ("output_tok_s", "output tok/s"),
    ]:
        print(f"  {label:28} {on[key]:12.0f} {off[key]:12.0f} {on[key] / off[key]:9.3f}")
    print(f"  vLLM CPU TTFT p50 (notes)    {VLLM_TTFT_P50_MS[True]:12} {VLLM_TTFT_P50_MS[False]:12}")
    print(
        f"  Pagoda TTFT p50 / vLLM's     {on['ttft_p50'] / VLLM_TTFT_P50_MS[True]:12.2f} "
        f"{off['ttft_p50'] / VLLM_TTFT_P50_MS[False]:12.2f}"
    )


if __name__ == "__main__":
    main()
