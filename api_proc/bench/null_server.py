"""A trivial OpenAI-style SSE server that streams tokens as fast as it can (measures the client, or a proxy).

Optionally it acts like a server of fixed capacity: at most `capacity` requests are served at once (the
rest wait their turn, as requests wait for a batch slot), and each spends `delay` seconds before its first
token (benchmarks/router.py slows one of three down this way). `chunks_per_write` is how many events go
out per socket write: a busy server's writes carry several (16, the default); 1 makes every event its own.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

CHUNK = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n'


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "null-model", "object": "model"}]})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


class NullServer:
    """Runs in a background thread with its own event loop; `url` is its base address."""

    def __init__(self, port: int, delay: float = 0.0, capacity: int | None = None, chunks_per_write: int = 16):
        self.url = f"http://127.0.0.1:{port}"
        self.delay = delay
        self.capacity = capacity
        self.chunks_per_write = chunks_per_write
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body["max_tokens"])
        if n < 0:
            return web.json_response(
                {
                    "error": {
                        "message": "max_tokens",
                        "type": "invalid_request_error",
                        "param": "max_tokens",
                        "code": None,
                    }
                },
                status=400,
            )
        if self._slots is None:
            return await self._stream(request, body, n)
        async with self._slots:
            return await self._stream(request, body, n)

    async def _stream(self, request: web.Request, body: dict, n: int) -> web.StreamResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        per_write = self.chunks_per_write
        for start in range(0, n, per_write):
            await response.write(CHUNK * min(per_write, n - start))
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    def _run(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self.capacity) if self.capacity else None
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", _health),
                web.get("/v1/models", _models),
                web.post("/v1/completions", self._completions),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
