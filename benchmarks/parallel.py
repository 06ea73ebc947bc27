"""Parallel execution, each case against its baseline in the same run.

  tp       tensor parallel on the CPU: TP=2 (two processes, one core each, gloo) vs TP=1 (one process, two
           threads; and one thread, for reference), the default model (SmolLM2-135M, float32):
           single-stream decode tok/s of one request (128-token prompt, 128 greedy tokens, in-process
           `EngineCore`, after a warm-up), and the time rank 0 spends in collectives per decode step (per
           layer one all-reduce after attention and one after the MLP, one for the embedding, one gather of
           the logits), which includes waiting for the other rank.
  pp       pipeline parallel on the CPU: PP=2 (two stages of 15 layers, one core each, up to two steps in
           flight) vs PP=1 x 2 threads (and x 1 thread, for reference), the default model: output tok/s
           of 16 requests (128-token prompts, 64 greedy tokens each) in an in-process `EngineCore`.
  dp       data parallel (real `pagoda serve` processes, driven over HTTP by the `pagoda bench serve`
           harness; random token-id prompts, ignore_eos, greedy): 2 replicas x 1 thread (one core each) vs
           1 engine x 2 threads, the same 64 requests (128 -> 128 tokens) at concurrency 64: output tok/s
           and their ratio.
  ray      start-up: `pagoda serve` launched until /health is 200 and a 1-token request answered, with
           --distributed-executor-backend ray (a local Ray cluster started by the server) vs mp, one replica.
  routing  2 replicas, P2C + prefix affinity vs round robin (--dp-routing), on a shared-prefix workload:
           16 groups of 4 requests, each group sharing a 1,024-token prefix (+ 32 unique tokens, 16
           output tokens), shuffled, at concurrency 8: median TTFT and prefix-cache hit rate.

The cases alternate (A B A B ...) over --repeats rounds so that load from other programs on the
machine hits both alike; every round's ratio is printed, then the medians.

    python -m benchmarks.parallel tp --repeats 3
    python -m benchmarks.parallel pp --repeats 3
    python -m benchmarks.parallel dp
    python -m benchmarks.parallel routing --repeats 3
    python -m benchmarks.parallel ray --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagoda.api_proc.bench.datasets import BenchRequest, random_requests
from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, http
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams

# tp case -> (tensor_parallel_size, torch threads per rank; None: the rank's share of the cores, here one)
CASES = {"TP=1 x 2 threads": (1, 2), "TP=2 x 1 core": (2, None), "TP=1 x 1 thread": (1, 1)}


def decode_run(tp: int, threads: int | None, prompt_tokens: int, new_tokens: int) -> dict:
    """One fresh engine: decode speed of a single request, and rank 0's collective time per step."""
    engine = EngineCore(EngineConfig(tensor_parallel_size=tp, num_threads=threads, kv_cache_memory=256 * 2**20))
    try:
        engine.warm_up()
        prompt = [(17 * i) % 4000 + 100 for i in range(prompt_tokens)]
        engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill, and the first token
        group = engine.runner.tp
        group.timing, group.collective_seconds, group.collective_calls = True, 0.0, 0
        steps = 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - started
        return {
            "tok_s": steps / elapsed,
            "step_ms": 1000 * elapsed / steps,
            "collective_ms": 1000 * group.collective_seconds / steps,
            "collectives": group.collective_calls / steps,
        }
    finally:
        engine.close()


def bench_tp(args) -> None:
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    baseline, parallel, single = CASES
    for round_ in range(args.repeats):
        for name, (tp, threads) in CASES.items():
            runs[name].append(decode_run(tp, threads, args.prompt_tokens, args.new_tokens))
        speeds = ", ".join(f"{name} {runs[name][-1]['tok_s']:.1f}" for name in CASES)
        ratio = runs[parallel][-1]["tok_s"] / runs[baseline][-1]["tok_s"]
        print(f"  round {round_ + 1}: tok/s {speeds}; TP=2 / TP=1 x 2 threads {ratio:.2f}", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    print(f"\nSingle-stream decode, {args.prompt_tokens}-token prompt -> {args.new_tokens} tokens, medians:")
    print(f"  {'':30}" + "".join(f"{name:>18}" for name in CASES))
    print(f"  {'decode tok/s':30}" + "".join(f"{median(name, 'tok_s'):18.1f}" for name in CASES))
    print(f"  {'ms per step':30}" + "".join(f"{median(name, 'step_ms'):18.2f}" for name in CASES))
    print(f"  {'TP=2 / TP=1 x 2 threads':30}{median(parallel, 'tok_s') / median(baseline, 'tok_s'):36.2f}")
    print(f"  {'TP=2 / TP=1 x 1 thread':30}{median(parallel, 'tok_s') / median(single, 'tok_s'):36.2f}")
    collective_ms = median(parallel, "collective_ms")
    print(
        f"  TP=2, rank 0: {median(parallel, 'collectives'):.0f} collectives per step, {collective_ms:.2f} ms "
        f"({collective_ms / median(parallel, 'step_ms'):.0%} of the step)"
    )


# pp case -> (pipeline_parallel_size, torch threads per rank; None: the rank's share of the cores, here one)
PP_CASES = {"PP=1 x 2 threads": (1, 2), "PP=2 x 1 core": (2, None), "PP=1 x 1 thread": (1, 1)}


def batch_run(pp: int, threads: int | None, num_requests: int, prompt_tokens: int, new_tokens: int) -> float:
    """One fresh engine: output tok/s over `num_requests` requests added at once."""
    config = EngineConfig(pipeline_parallel_size=pp, num_threads=threads, kv_cache_memory=256 * 2**20)
    engine = EngineCore(config)
    try:
        engine.warm_up()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for r in range(num_requests):
            engine.add_request(f"r{r}", [(17 * i + 31 * r) % 4000 + 100 for i in range(prompt_tokens)], params)
        tokens = 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            tokens += len(engine.step())
        return tokens / (time.perf_counter() - started)
    finally:
        engine.close()


def bench_pp(args) -> None:
    runs: dict[str, list[float]] = {name: [] for name in PP_CASES}
    baseline, parallel, single = PP_CASES
    for round_ in range(args.repeats):
        for name, (pp, threads) in PP_CASES.items():
            runs[name].append(batch_run(pp, threads, args.requests, args.prompt_tokens, args.new_tokens))
        speeds = ", ".join(f"{name} {runs[name][-1]:.1f}" for name in PP_CASES)
        print(
            f"  round {round_ + 1}: output tok/s {speeds}; PP=2 / PP=1 x 2 threads "
            f"{runs[parallel][-1] / runs[baseline][-1]:.2f}",
            flush=True,
        )
    medians = {name: statistics.median(runs[name]) for name in PP_CASES}
    print(f"\n{args.requests} requests, {args.prompt_tokens}-token prompts -> {args.new_tokens} tokens, medians:")
    print("  " + ", ".join(f"{name} {medians[name]:.1f} tok/s" for name in PP_CASES))
    print(
        f"  PP=2 / PP=1 x 2 threads {medians[parallel] / medians[baseline]:.2f}; "
        f"PP=2 / PP=1 x 1 thread {medians[parallel] / medians[single]:.2f}"
    )


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


def time_to_ready(args: list[str]) -> float:
    """Seconds from launching `pagoda serve` until it has answered a 1-token request."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        server = PagodaServer(Path(tmp), *args, ready_timeout=300)
        try:
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
            status, _ = http("POST", server.base_url + "/v1/completions", body)
            assert status == 200, status
            return time.perf_counter() - started
        finally:
            server.stop()


def bench_ray(args) -> None:
    cases = {"mp": [], "ray": ["--distributed-executor-backend", "ray"]}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.repeats):
        for name, extra in cases.items():
            times[name].append(time_to_ready(extra))
        print(f"  round {round_ + 1}: mp {times['mp'][-1]:.1f} s, ray {times['ray'][-1]:.1f} s", flush=True)
    mp, ray = (statistics.median(times[name]) for name in cases)
    print(f"\nReady (first answer) after launch, medians: mp {mp:.1f} s, ray {ray:.1f} s; ray / mp {ray / mp:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = parser.add_subparsers(dest="case", required=True)
    tp = cases.add_parser("tp", help="tensor parallel: TP=2 x 1 core vs TP=1 x 2 threads, single-stream decode")
    tp.add_argument("--repeats", type=int, default=3)
    tp.add_argument("--prompt-tokens", type=int, default=128)
    tp.add_argument("--new-tokens", type=int, default=128)
    tp.set_defaults(func=bench_tp)
    pp = cases.add_parser("pp", help="pipeline parallel: PP=2 x 1 core vs PP=1 x 2 threads, 16 requests")
    pp.add_argument("--repeats", type=int, default=3)
    pp.add_argument("--requests", type=int, default=16)
    pp.add_argument("--prompt-tokens", type=int, default=128)
    pp.add_argument("--new-tokens", type=int, default=64)
    pp.set_defaults(func=bench_pp)
    for name, func in (("dp", bench_dp), ("routing", bench_routing), ("ray", bench_ray)):
        case = cases.add_parser(name)
        case.add_argument("--repeats", type=int, default=2, help="rounds of every case, alternating")
        case.set_defaults(func=func)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
