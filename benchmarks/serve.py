"""Serving benchmark: a real `pagoda serve`, driven over HTTP the way `vllm bench serve` drives vLLM.

Workloads (random token-id prompts of exact length, ignore_eos, greedy, streaming completions), the
ones vLLM's CPU build was measured on with this model on this machine kind (../shared/anchors/peers-cpu.md):
  c16      64 requests 128 -> 128 tokens at concurrency 16   (vLLM: 96.5 tok/s, TTFT p50 4027 ms, TPOT p50 137 ms)
  c64      the same at concurrency 64                         (vLLM: 142.6 tok/s, TTFT p50 10262 ms)
  single   one stream 512 -> 256 tokens, 3 runs               (vLLM: TTFT 1013 ms, 15.5 tok/s decode)
  overhead 1-token requests one at a time: HTTP vs the direct ZeroMQ client (mean latency)
Also: launch -> /health 200, the RSS of every process, and the CPU share of the api and detok
processes during c64. Ratios against vLLM are printed last.

    python benchmarks/serve.py                    # starts its own server on a free port
    python benchmarks/serve.py --only c16 single
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server import PagodaServer, http  # noqa: E402

VLLM = {"c16": {"tok_s": 96.5, "ttft_p50": 4027, "tpot_p50": 136.6}, "c64": {"tok_s": 142.6, "ttft_p50": 10262},
        "single": {"ttft": 1013, "decode_tok_s": 15.5}, "ready_s": 175}


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


async def one_request(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, usage = [], None
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"]:
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    tokens = usage["completion_tokens"]
    assert tokens == max_tokens, (tokens, max_tokens)
    ttft = arrivals[0] - start
    return {"ttft": ttft, "e2e": end - start, "tokens": tokens,
            "tpot": (end - start - ttft) / max(tokens - 1, 1),
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def run_load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def limited(prompt):
            async with semaphore:
                return await one_request(session, url, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    ms = 1000.0
    return {"duration_s": duration, "output_tok_s": sum(r["tokens"] for r in results) / duration,
            "ttft_p50": statistics.median(r["ttft"] for r in results) * ms,
            "ttft_mean": statistics.mean(r["ttft"] for r in results) * ms,
            "ttft_p99": sorted(r["ttft"] for r in results)[int(0.99 * (len(results) - 1))] * ms,
            "tpot_p50": statistics.median(r["tpot"] for r in results) * ms,
            "itl_p50": statistics.median(x for r in results for x in r["itl"]) * ms}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def process_names(server: PagodaServer) -> dict[int, str]:
    names = {server.process.pid: "parent"}
    for pid in server.children():
        names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return names


async def overhead(server: PagodaServer, count: int = 40) -> dict:
    from api_proc.client import AsyncEngineClient
    from engine_core.sampling_params import SamplingParams

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
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="pagoda-bench-"))
    launched = time.perf_counter()
    server = PagodaServer(tmp, "--kv-cache-memory", args.kv_cache_memory, *args.server_args, remove_dir_on_stop=True)
    ready_s = time.perf_counter() - launched
    url = server.base_url
    rows = [("launch -> /health 200", f"{ready_s:.1f} s", f"{VLLM['ready_s'] / ready_s:.0f}x faster")]
    try:
        http("POST", url + "/v1/completions", {"prompt": [5] * 8, "max_tokens": 2})
        if "c16" in args.only:
            r = asyncio.run(run_load(url, random_prompts(64, 128, 0), 128, 16))
            v = VLLM["c16"]
            rows += [("c16 output tok/s", f"{r['output_tok_s']:.1f}", f"{r['output_tok_s'] / v['tok_s']:.2f}x vLLM"),
                     ("c16 TTFT p50 / p99 ms", f"{r['ttft_p50']:.0f} / {r['ttft_p99']:.0f}",
                      f"{r['ttft_p50'] / v['ttft_p50']:.2f} of vLLM's"),
                     ("c16 TPOT p50 / ITL p50 ms", f"{r['tpot_p50']:.1f} / {r['itl_p50']:.1f}",
                      f"{r['tpot_p50'] / v['tpot_p50']:.2f} of vLLM's")]
        if "c64" in args.only:
            names = process_names(server)
            before = {pid: cpu_seconds(pid) for pid in names}
            r = asyncio.run(run_load(url, random_prompts(64, 128, 1), 128, 64))
            used = {pid: cpu_seconds(pid) - before[pid] for pid in names}
            total = sum(used.values())
            share = {names[p]: used[p] / total for p in used}
            v = VLLM["c64"]
            rows += [("c64 output tok/s", f"{r['output_tok_s']:.1f}", f"{r['output_tok_s'] / v['tok_s']:.2f}x vLLM"),
                     ("c64 TTFT p50 ms", f"{r['ttft_p50']:.0f}", f"{r['ttft_p50'] / v['ttft_p50']:.2f} of vLLM's"),
                     ("c64 CPU share api / detok / engine",
                      " / ".join(f"{100 * sum(s for n, s in share.items() if n == k):.1f}%"
                                 for k in ("pagoda-api", "pagoda-detok", "pagoda-engine")), "")]
        if "single" in args.only:
            runs = [asyncio.run(run_load(url, random_prompts(1, 512, seed), 256, 1)) for seed in (1, 2, 3)]
            ttft = statistics.median(r["ttft_p50"] for r in runs)
            decode = statistics.median(1000.0 / r["tpot_p50"] for r in runs)
            v = VLLM["single"]
            rows += [("single 512->256 TTFT ms", f"{ttft:.0f}", f"{ttft / v['ttft']:.2f} of vLLM's"),
                     ("single decode tok/s", f"{decode:.1f}", f"{decode / v['decode_tok_s']:.2f}x vLLM")]
        if "overhead" in args.only:
            o = asyncio.run(overhead(server))
            rows += [("1-token request, HTTP / direct ms", f"{o['http_ms']:.1f} / {o['direct_ms']:.1f}",
                      f"direct = {o['direct_ms'] / o['http_ms']:.2f} of HTTP")]
        names = process_names(server)
        rss = {names[p]: rss_bytes(p) for p in names}
        # The KV pool is reserved with torch.empty: only the pages requests have touched are resident,
        # so this total includes the used part of the pool.
        total = sum(rss.values()) / 1024 ** 3
        rows.append(("RSS, all processes (incl. touched KV)", f"{total:.2f} GiB",
                     ", ".join(f"{n} {b / 1024 ** 2:.0f} MiB" for n, b in rss.items())))
    finally:
        server.stop()
    width = max(len(r[0]) for r in rows)
    print("\nPagoda serving benchmark (SmolLM2-135M fp32, this machine)")
    for name, value, ratio in rows:
        print(f"  {name:<{width}}  {value:>16}  {ratio}")


if __name__ == "__main__":
    main()
