"""`pagoda bench serve`: drive an OpenAI-compatible server with a dataset at a request rate.

Arrivals follow a gamma process (burstiness 1 = Poisson, like vLLM's harness; rate inf = all at once),
optionally capped at a number of requests in flight. Every request streams, so TTFT and inter-token
latency are measured on the client, where users feel them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from pagoda.api_proc.bench.client import RequestResult, request_body, send
from pagoda.api_proc.bench.datasets import BenchRequest


def normalize_base_url(base_url: str) -> str:
    base_url = base_url.rstrip("/")
    return base_url[:-3] if base_url.endswith("/v1") else base_url


async def served_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"GET /v1/models answered {response.status}: {await response.text()}")
        return (await response.json())["data"][0]["id"]


async def run_serve(
    base_url: str,
    requests: list[BenchRequest],
    *,
    endpoint: str = "completions",
    model: str | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestResult], float, str]:
    """Send every request; returns (results in dataset order, wall seconds, model name)."""
    base_url = normalize_base_url(base_url)
    url = base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = model or await served_model(session, base_url, headers)

        async def one(request: BenchRequest, start: float) -> RequestResult:
            body = request_body(endpoint, model, request, ignore_eos, temperature)
            if limit is None:
                result = await send(session, url, body, request, start, headers)
            else:
                async with limit:
                    result = await send(session, url, body, request, start, headers)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(one(request, start)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration, model


def save_result(
    path: str | Path, summary: dict, settings: dict, results: list[RequestResult], flat: dict | None = None
) -> None:
    """The summary, the settings and every request's timings (seconds) as JSON; `flat`: top-level keys
    beside them (vLLM's: api_proc/bench/vllm_compat.py)."""
    per_request = [{**asdict(r), "itl": r.itl, "tpot": r.tpot} for r in results]
    body = {**(flat or {}), "settings": settings, "summary": summary, "requests": per_request}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(body, indent=1))
