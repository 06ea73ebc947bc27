"""One streamed request to any OpenAI-compatible server, timed chunk by chunk.

Chunks are decoded with typed msgspec structs that read only the fields the timings need, so one
client process keeps up with hundreds of concurrent streams.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pagoda.api_proc.bench.datasets import BenchRequest


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # seconds since the run began
    ttft: float = 0.0
    e2el: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, since start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def request_body(endpoint: str, model: str | None, request: BenchRequest, ignore_eos: bool, temperature: float) -> dict:
    body = {
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


async def send(
    session: aiohttp.ClientSession, url: str, body: dict, request: BenchRequest, run_start: float, headers: dict
) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    sent = time.perf_counter()
    result.start = sent - run_start
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = _decode_chunk(payload)
                if chunk.error is not None:
                    result.error = f"stream error: {chunk.error.get('message', chunk.error)}"
                    return result
                if chunk.usage is not None:
                    result.output_len = chunk.usage.completion_tokens
                    result.prompt_len = chunk.usage.prompt_tokens or result.prompt_len
                for choice in chunk.choices:
                    text = choice.text if choice.delta is None else choice.delta.content
                    if text:  # not the role-only first chunk of a chat stream, nor an empty final one
                        result.chunk_times.append(time.perf_counter() - sent)
                        chunks += 1
        result.e2el = time.perf_counter() - sent
        if not result.chunk_times:
            result.error = "the stream ended without any token"
            return result
        result.ttft = result.chunk_times[0]
        if result.output_len == 0:  # the server sent no usage: count chunks
            result.output_len = chunks
        result.success = True
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.e2el = time.perf_counter() - sent
    return result
