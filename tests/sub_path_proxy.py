"""A reverse proxy that serves a server under a sub-path, as an operator's nginx would
(`http://127.0.0.1:PORT/llm/...` -> `http://server/...`), to show the web app uses relative URLs only:
any request outside the sub-path is a 404 here. Bodies stream through (SSE arrives chunk by chunk).
It runs its own event loop on a thread, so a synchronous test (Playwright's sync API) can use it."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
from aiohttp import web

from pagoda.api_proc.bench.local_server import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class SubPathProxy:
    def __init__(self, target: str, prefix: str = "/llm/"):
        self.target = target.rstrip("/")
        self.prefix = prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{prefix}"
        self.outside_paths: list[str] = []  # what was asked outside the sub-path (should stay empty)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SubPathProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)

        async def start() -> None:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._session = aiohttp.ClientSession(auto_decompress=False)

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._session.close())
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if not request.path.startswith(self.prefix):
            self.outside_paths.append(request.path)
            return web.Response(status=404, text="outside the proxied sub-path")
        url = self.target + "/" + request.path_qs[len(self.prefix) :]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
        async with self._session.request(request.method, url, headers=headers, data=await request.read()) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
