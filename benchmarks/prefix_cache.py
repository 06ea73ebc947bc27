"""Prefix caching: the same workload against a server with caching on and one with it off, same run.

32 requests share a 1,024-token prefix and add 32 unique tokens each; 32 output tokens (ignore_eos),
8 at a time, streamed over HTTP. vLLM's CPU build, same workload over HTTP on this machine kind
(../shared/anchors/peers-cpu.md): median TTFT 1.09 s with caching, 10.9 s without.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import run_load  # noqa: E402
from tests.server import PagodaServer, http  # noqa: E402

VLLM_TTFT_P50_MS = {True: 1091, False: 10893}


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49000) for _ in range(1024)]
    return [prefix + [rng.randrange(100, 49000) for _ in range(32)] for _ in range(32)]


def measure(caching: bool) -> dict:
    args = [] if caching else ["--no-prefix-caching"]
    server = PagodaServer(Path(tempfile.mkdtemp(prefix="pagoda-bench-")), *args, remove_dir_on_stop=True)
    try:
        http("POST", server.base_url + "/v1/completions", {"prompt": [5] * 8, "max_tokens": 2})
        started = time.perf_counter()
        result = asyncio.run(run_load(server.base_url, workload(), 32, 8))
        result["wall_s"] = time.perf_counter() - started
        result["total_tok_s"] = 32 * (1056 + 32) / result["duration_s"]
        return result
    finally:
        server.stop()


def main() -> None:
    on, off = measure(True), measure(False)
    print("\nPrefix caching: 32 x (1024 shared + 32 unique) -> 32 tokens, concurrency 8, over HTTP")
    print(f"  {'':28} {'caching on':>12} {'caching off':>12} {'on / off':>9}")
    for key, label in [("ttft_p50", "TTFT p50 ms"), ("ttft_mean", "TTFT mean ms"),
                       ("total_tok_s", "total tok/s (in + out)"), ("output_tok_s", "output tok/s")]:
        print(f"  {label:28} {on[key]:12.0f} {off[key]:12.0f} {on[key] / off[key]:9.3f}")
    print(f"  vLLM CPU TTFT p50 (notes)    {VLLM_TTFT_P50_MS[True]:12} {VLLM_TTFT_P50_MS[False]:12}")
    print(f"  Pagoda TTFT p50 / vLLM's     {on['ttft_p50'] / VLLM_TTFT_P50_MS[True]:12.2f} "
          f"{off['ttft_p50'] / VLLM_TTFT_P50_MS[False]:12.2f}")


if __name__ == "__main__":
    main()
