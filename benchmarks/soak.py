"""Soak test: a live server under a mix of good and bad clients at high concurrency.

About 2,000 requests (bounded in count and time, loopback only) against a real `pagoda serve` with an
API key and limits: valid completions and chats (streamed and not), malformed JSON, wrong types,
oversized bodies, over-long prompts, clients that disconnect mid-stream or time out, and clients with
no key or a wrong key; and the hostile-input probe's mix: temperatures too small for float32 (greedy),
a repetition penalty that would overflow it, a 20,000-property JSON schema beside small constrained
requests, public /metrics scrapes, odd Content-Encodings and lone surrogates.

Afterwards: every valid request answered 200 with exactly its tokens (none lost, hung or 5xx), every
bad one got its 4xx, the server kept the same processes (none restarted), the engine holds no request
and no KV block, and the server processes' memory grew by less than 10 % between the end of the
warm-up and the end.

    python benchmarks/soak.py                      # ~2,000 requests, concurrency 64
    python benchmarks/soak.py --requests 500 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, process_names, rss_bytes, wait_until

KEY = "soak-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# kind -> share of the mix; "valid" kinds must all succeed, the others must get their 4xx.
MIX = {
    "completion": 20,
    "completion_stream": 20,
    "chat": 10,
    "chat_stream": 10,
    "malformed_json": 6,
    "wrong_type": 6,
    "oversized": 4,
    "prompt_too_long": 4,
    "disconnect": 8,
    "client_timeout": 4,
    "no_key": 4,
    "wrong_key": 4,
    # the hostile-input probe's mix
    "tiny_temperature": 4,
    "overflowing_penalty": 2,
    "small_regex": 4,
    "huge_schema": 1,
    "metrics_scrape": 6,
    "odd_encoding": 2,
    "lone_surrogate": 2,
}
VALID = {"completion", "completion_stream", "chat", "chat_stream", "tiny_temperature"}  # exactly their tokens
EXPECTED_STATUS = {
    "small_regex": 200,
    "metrics_scrape": 200,
    "overflowing_penalty": 400,
    "huge_schema": 400,
    "odd_encoding": 400,
    "lone_surrogate": 400,
    "malformed_json": 400,
    "wrong_type": 400,
    "oversized": 413,
    "prompt_too_long": 400,
    "no_key": 401,
    "wrong_key": 401,
}


# A schema whose grammar would take minutes to compile (20,000 properties, ~570 KB): refused by size.
HUGE_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20_000)}}
ODD_ENCODING = {**AUTH, "Content-Encoding": "x-gzip"}


def body_for(kind: str, rng: random.Random) -> tuple[str, dict | bytes, dict]:
    """(path, JSON body or raw bytes, headers) for one request of `kind`."""
    max_tokens = rng.randint(4, 16)
    completion = {
        "model": MODEL_NAME,
        "prompt": [rng.randrange(100, 49000) for _ in range(rng.randint(8, 96))],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Tell me about the number {rng.random()}"}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    return {
        "completion": ("/v1/completions", completion, AUTH),
        "completion_stream": ("/v1/completions", {**completion, **stream}, AUTH),
        "chat": ("/v1/chat/completions", chat, AUTH),
        "chat_stream": ("/v1/chat/completions", {**chat, **stream}, AUTH),
        "malformed_json": ("/v1/completions", b'{"prompt": "unfinished', AUTH),
        "wrong_type": ("/v1/chat/completions", {**chat, "messages": "not a list", "max_tokens": "many"}, AUTH),
        "oversized": ("/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}', AUTH),
        "prompt_too_long": ("/v1/completions", {**completion, "prompt": [5] * 9000}, AUTH),
        "disconnect": ("/v1/completions", {**completion, **stream, "max_tokens": 64}, AUTH),
        "client_timeout": ("/v1/chat/completions", {**chat, "max_tokens": 64}, AUTH),
        "no_key": ("/v1/completions", completion, {}),
        "tiny_temperature": ("/v1/completions", {**completion, "temperature": rng.choice([1e-45, 1e-40, 1e-50])}, AUTH),
        "overflowing_penalty": ("/v1/completions", {**completion, "repetition_penalty": 1e-45}, AUTH),
        "small_regex": ("/v1/completions", {**completion, "guided_regex": "[0-9]+", "ignore_eos": False}, AUTH),
        "huge_schema": ("/v1/completions", {**completion, "guided_json": HUGE_SCHEMA}, AUTH),
        "metrics_scrape": ("/metrics", b"", {}),
        "odd_encoding": ("/v1/completions", gzip.compress(json.dumps(completion).encode()), ODD_ENCODING),
        "lone_surrogate": ("/v1/completions", json.dumps(completion)[:-1].encode() + b', "user": "\\ud800"}', AUTH),
        "wrong_key": ("/v1/completions", completion, {"Authorization": "Bearer not-the-key-at-all"}),
    }[kind]


async def one(session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random) -> tuple[str, str]:
    """(kind, outcome); outcome "ok" when the server answered as it must."""
    path, body, headers = body_for(kind, rng)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**headers, "Content-Type": "application/json"}
    try:
        if kind == "client_timeout":  # gives up before the answer: the server must abort, not leak
            try:
                async with session.post(
                    url + path, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=rng.uniform(0.05, 0.5))
                ) as response:
                    await response.read()
            except asyncio.TimeoutError:
                pass
            return kind, "ok"
        method = "GET" if kind == "metrics_scrape" else "POST"
        async with session.request(
            method, url + path, data=data or None, headers=headers, timeout=aiohttp.ClientTimeout(total=300)
        ) as response:
            if kind == "disconnect":
                await response.content.readline()
                return kind, "ok"  # leaving the block closes the connection mid-stream
            raw = await response.read()
            if kind not in VALID:
                expected = EXPECTED_STATUS[kind]
                ok = response.status == expected and (expected == 200 or "error" in json.loads(raw))
                return kind, "ok" if ok else f"status {response.status}, expected {expected}"
            if response.status != 200:
                return kind, f"status {response.status}: {raw[:200]!r}"
            return kind, "ok" if _generated(raw, body["max_tokens"], body.get("stream", False)) else "wrong token count"
    except asyncio.TimeoutError:
        return kind, "hung"
    except aiohttp.ClientError as exc:
        return kind, f"client error {type(exc).__name__}" if kind in VALID else "ok"


def _generated(raw: bytes, max_tokens: int, stream: bool) -> bool:
    if not stream:
        return json.loads(raw)["usage"]["completion_tokens"] == max_tokens
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    if events[-1] != b"[DONE]":
        return False
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    return bool(usage) and usage[-1]["completion_tokens"] == max_tokens


async def run(url: str, kinds: list[str], concurrency: int, seed: int, deadline: float) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def limited(kind: str):
            async with semaphore:
                if time.monotonic() > deadline:
                    return kind, "skipped (time bound)"
                return await one(session, url, kind, random.Random(rng.random()))

        return await asyncio.gather(*(limited(k) for k in kinds))


async def engine_state(url: str) -> dict[str, float]:
    """Running / waiting requests and KV usage, from /metrics (the engine's own step stats)."""
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def server_rss(server: PagodaServer) -> dict[str, int]:
    """RSS of each server process by name (parent, pagoda-engine, pagoda-detok, pagoda-api)."""
    return {name: rss_bytes(pid) for pid, name in process_names(server).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=200, help="requests before the first memory reading")
    parser.add_argument("--max-seconds", type=float, default=900, help="stop starting requests after this long")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    population = [kind for kind, weight in MIX.items() for _ in range(weight)]
    kinds = [rng.choice(population) for _ in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="pagoda-soak-"))
    server = PagodaServer(
        tmp, "--api-key", KEY, "--max-body-size", "1MiB", "--max-model-len", "4096", remove_dir_on_stop=True
    )
    url = server.base_url
    try:
        # The KV pool's pages are mapped by an idle thread after start (engine_core/kv_prefault.py): wait
        # for it, so that the pool becoming resident is not read as growth between the two readings.
        wait_until(lambda: "KV pool" in server.log() and "populated" in server.log(), timeout=60)
        started = time.monotonic()
        deadline = started + args.max_seconds
        processes = sorted(process_names(server))  # (a restarted engine or tokenizer process has a new pid)
        results = asyncio.run(run(url, kinds[: args.warmup], args.concurrency, args.seed, deadline))
        rss_start = server_rss(server)
        results += asyncio.run(run(url, kinds[args.warmup :], args.concurrency, args.seed + 1, deadline))
        elapsed = time.monotonic() - started
        time.sleep(2)  # aborts of the last disconnects reach the engine
        state = asyncio.run(engine_state(url))
        rss_end = server_rss(server)
        alive = server.process.poll() is None
        same_processes = sorted(process_names(server)) == processes
    finally:
        server.stop()
    outcomes = collections.Counter((kind, outcome) for kind, outcome in results)
    failures = {key: n for key, n in outcomes.items() if key[1] not in ("ok", "skipped (time bound)")}
    valid = sum(n for (kind, outcome), n in outcomes.items() if kind in VALID and outcome == "ok")
    skipped = sum(n for (_, outcome), n in outcomes.items() if outcome.startswith("skipped"))
    growth = sum(rss_end.values()) / sum(rss_start.values()) - 1
    print(
        f"{len(results)} requests ({skipped} skipped by the time bound) in {elapsed:.0f} s at concurrency "
        f"{args.concurrency}; server alive: {alive}; the same processes throughout: {same_processes}"
    )
    print(f"{'kind':<20} {'requests':>8} {'as required':>12}")
    for kind in MIX:
        total = sum(n for (k, _), n in outcomes.items() if k == kind)
        ok = outcomes.get((kind, "ok"), 0)
        print(f"{kind:<20} {total:>8} {ok:>12}")
    print(f"valid requests answered 200 with exactly their tokens: {valid}")
    print(f"failures: {failures or 'none'}")
    print(f"engine after the run: {state}")
    print(
        f"server RSS: {sum(rss_start.values()) / 2**20:.0f} MiB after warm-up -> "
        f"{sum(rss_end.values()) / 2**20:.0f} MiB at the end ({100 * growth:+.1f} %); by process: "
        + ", ".join(f"{name} {rss_start[name] / 2**20:.0f} -> {rss_end.get(name, 0) / 2**20:.0f}" for name in rss_start)
    )
    clean = (
        alive
        and same_processes
        and not failures
        and state.get("vllm:num_requests_running") == 0
        and state.get("vllm:num_requests_waiting") == 0
        and state.get("vllm:kv_cache_usage_perc") == 0
        and growth < 0.10
    )
    print("PASS" if clean else "FAIL")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
