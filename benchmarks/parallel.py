"""Parallel execution, each case against its baseline in the same run (real `pagoda serve` processes,
driven over HTTP by the `pagoda bench serve` harness; random token-id prompts, ignore_eos, greedy).

  dp       data parallel: 2 replicas x 1 thread (one core each) vs 1 engine x 2 threads, the same
           64 requests (128 -> 128 tokens) at concurrency 64: output tok/s and their ratio.
  routing  2 replicas, P2C + prefix affinity vs round robin (--dp-routing), on a shared-prefix workload:
           16 groups of 4 requests, each group sharing a 1,024-token prefix (+ 32 unique tokens, 16
           output tokens), shuffled, at concurrency 8: median TTFT and prefix-cache hit rate.

The cases alternate (A B A B ...) over --repeats rounds so that load from other programs on the
machine hits both alike; every round's ratio is printed, then the medians.

    python benchmarks/parallel.py dp
    python benchmarks/parallel.py routing --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from api_proc.bench.datasets import BenchRequest, random_requests
from api_proc.bench.local_server import PagodaServer, http
from api_proc.bench.metrics import summarize
from api_proc.bench.runner import run_serve


def counters(server: PagodaServer, *names: str) -> dict[str, float]:
    """The sum over engines of each named sample in /metrics."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def run(server_args: list[str], requests: list[BenchRequest], concurrency: int) -> dict:
    """One fresh server: the requests' summary, plus the prefix-cache hit rate they had."""
    server = PagodaServer(Path(tempfile.mkdtemp(prefix="pagoda-bench-")), *server_args, remove_dir_on_stop=True)
    try:
        http("POST", server.base_url + "/v1/completions", {"prompt": [5] * 8, "max_tokens": 2})  # warm
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        before = counters(server, *names)
        results, duration, _ = asyncio.run(
            run_serve(server.base_url, requests, max_concurrency=concurrency, progress=False)
        )
        after = counters(server, *names)
    finally:
        server.stop()
    summary = summarize(results, duration)
    assert summary["failed"] == 0, summary
    queries = after[names[1]] - before[names[1]]
    summary["hit_rate"] = (after[names[0]] - before[names[0]]) / queries if queries else 0.0
    return summary


def alternate(cases: dict[str, list[str]], requests: list[BenchRequest], concurrency: int, repeats: int):
    """{case: [summary per round]}, the cases run in turn each round."""
    out: dict[str, list[dict]] = {name: [] for name in cases}
    for round_ in range(repeats):
        for name, server_args in cases.items():
            out[name].append(run(server_args, requests, concurrency))
            print(f"  round {round_ + 1} {name}: done", flush=True)
    return out


def bench_dp(args) -> None:
    requests = random_requests(64, 128, 128, seed=0)
    cases = {
        "DP=2 x 1 thread": ["--data-parallel-size", "2", "--kv-cache-memory", "1GiB"],
        "DP=1 x 2 threads": ["--num-threads", "2", "--kv-cache-memory", "2GiB"],
    }
    out = alternate(cases, requests, 64, args.repeats)
    dp, single = (out[name] for name in cases)
    print("\nData parallel: 64 requests 128 -> 128 tokens, concurrency 64, over HTTP")
    print(f"  {'round':>5} {'DP=2x1 tok/s':>13} {'DP=1x2 tok/s':>13} {'ratio':>7}")
    ratios = []
    for i, (a, b) in enumerate(zip(dp, single, strict=True)):
        ratios.append(a["output_throughput"] / b["output_throughput"])
        print(f"  {i + 1:>5} {a['output_throughput']:13.1f} {b['output_throughput']:13.1f} {ratios[-1]:7.2f}")
    print(
        f"  {'median':>5} {statistics.median(a['output_throughput'] for a in dp):13.1f} "
        f"{statistics.median(b['output_throughput'] for b in single):13.1f} {statistics.median(ratios):7.2f}"
    )


def shared_prefix_requests(groups: int, per_group: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(groups):
        prefix = [rng.randrange(100, 30000) for _ in range(1024)]
        for _ in range(per_group):
            requests.append(BenchRequest(prefix + [rng.randrange(100, 30000) for _ in range(32)], 1056, 16))
    rng.shuffle(requests)
    return requests


def bench_routing(args) -> None:
    requests = shared_prefix_requests(16, 4)
    common = ["--data-parallel-size", "2", "--kv-cache-memory", "1GiB"]
    cases = {"p2c": [*common, "--dp-routing", "p2c"], "round_robin": [*common, "--dp-routing", "round_robin"]}
    out = alternate(cases, requests, 8, args.repeats)
    p2c, rr = out["p2c"], out["round_robin"]
    print("\nRouting, 2 replicas: 16 groups x 4 requests sharing a 1,024-token prefix (+32) -> 16, concurrency 8")
    print(f"  {'round':>5} {'TTFT p50 ms p2c':>16} {'round robin':>12} {'ratio':>6} {'hit rate p2c':>13} {'rr':>6}")
    for i, (a, b) in enumerate(zip(p2c, rr, strict=True)):
        ta, tb = a["ttft_ms"]["median"], b["ttft_ms"]["median"]
        print(f"  {i + 1:>5} {ta:16.0f} {tb:12.0f} {ta / tb:6.2f} {a['hit_rate']:13.3f} {b['hit_rate']:6.3f}")
    ta = statistics.median(a["ttft_ms"]["median"] for a in p2c)
    tb = statistics.median(b["ttft_ms"]["median"] for b in rr)
    ha = statistics.median(a["hit_rate"] for a in p2c)
    hb = statistics.median(b["hit_rate"] for b in rr)
    print(f"  {'median':>5} {ta:16.0f} {tb:12.0f} {ta / tb:6.2f} {ha:13.3f} {hb:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = parser.add_subparsers(dest="case", required=True)
    for name, func in (("dp", bench_dp), ("routing", bench_routing)):
        case = cases.add_parser(name)
        case.add_argument("--repeats", type=int, default=2, help="rounds of every case, alternating")
        case.set_defaults(func=func)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
