"""The router's backends: their state, the health checks that eject and re-admit them, and the load
that Pagoda backends report on `GET /load`.

- In rotation or ejected: a backend is ejected after `eject_after_failures` consecutive failures, of
  its health probes (`GET /health` answering anything but 200, or not within the probe timeout) and of
  requests (no connection, no byte within --read-timeout, closed before or during a response). Any
  success resets the count. Ejected backends keep being probed at the same interval, and the first
  passing probe re-admits them (only a probe: a late answer to a request sent before the ejection
  does not).
- Load: the router counts each backend's requests in flight itself (its own traffic, always known).
  Pagoda backends also report running and waiting requests and KV-cache usage on `GET /load`, polled
  every `load_poll_interval` (250 ms), which covers traffic from other clients and other routers. A
  backend answering 404 there is not Pagoda (vLLM, llama.cpp, ...): it is not asked again until it
  comes back from an ejection (it may have been replaced), and its in-flight count is its load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pagoda.api_proc.router.metrics import RouterMetrics
from pagoda.api_proc.router.settings import RouterSettings

logger = logging.getLogger("pagoda.router")


class BackendLoad(msgspec.Struct, frozen=True):
    """A Pagoda backend's `GET /load`."""

    running: int
    waiting: int
    kv_cache_usage: float


_decode_load = msgspec.json.Decoder(BackendLoad).decode


@dataclass(eq=False)
class Backend:
    url: str
    index: int  # its place in --backend order (round robin goes by it)
    up: bool = True  # in rotation
    in_flight: int = 0  # requests the router is sending to it or relaying from it now
    consecutive_failures: int = 0
    load: BackendLoad | None = None  # its latest GET /load; None: not Pagoda, or not answering
    polls_load: bool = True  # False once /load answered 404
    last_error: str = ""
    _tasks: list[asyncio.Task] = field(default_factory=list, repr=False)

    @property
    def score(self) -> float:
        """How loaded it is (lower is better): requests in flight, or the running and waiting requests it
        reports if it reports more (others' traffic), scaled by KV-cache usage as the data-parallel
        routing does (detok_proc/routing.py): a backend whose pool is full counts double."""
        if self.load is None:
            return float(self.in_flight)
        requests = max(self.in_flight, self.load.running + self.load.waiting)
        return requests * (1.0 + self.load.kv_cache_usage)

    def state(self) -> dict:
        """Its line in the router's /health."""
        return {
            "url": self.url,
            "state": "up" if self.up else "ejected",
            "in_flight": self.in_flight,
            "consecutive_failures": self.consecutive_failures,
            "load": None if self.load is None else msgspec.structs.asdict(self.load),
            "last_error": self.last_error or None,
        }


class BackendPool:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics, session: aiohttp.ClientSession):
        self.settings = settings
        self.metrics = metrics
        self.session = session
        self.backends = [Backend(url, i) for i, url in enumerate(settings.backends)]
        self.headers = {"Authorization": f"Bearer {settings.backend_api_key}"} if settings.backend_api_key else {}
        for backend in self.backends:
            metrics.in_flight.labels(backend.url).set_function(lambda b=backend: b.in_flight)

    def up(self) -> list[Backend]:
        return [b for b in self.backends if b.up]

    # ---- outcomes --------------------------------------------------------------------------------
    def failed(self, backend: Backend, kind: str, reason: str) -> None:
        """A failure of `kind` (metrics.ERROR_KINDS): counted, and it ejects the backend on the Nth in a row."""
        self.metrics.errors.labels(backend.url, kind).inc()
        backend.last_error = reason
        backend.consecutive_failures += 1
        if backend.up and backend.consecutive_failures >= self.settings.eject_after_failures:
            backend.up = False
            backend.load = None
            self.metrics.up.labels(backend.url).set(0)
            self.metrics.ejections.labels(backend.url).inc()
            logger.warning(
                "ejected backend %s after %d failures in a row (last: %s)",
                backend.url,
                backend.consecutive_failures,
                reason,
            )

    def succeeded(self, backend: Backend) -> None:
        """A request got its answer: the failures in a row end (an ejected backend waits for its probe)."""
        if backend.up:
            backend.consecutive_failures = 0

    def _passed_probe(self, backend: Backend) -> None:
        backend.consecutive_failures = 0
        if not backend.up:
            backend.up = True
            backend.polls_load = True  # it may be another server now
            self.metrics.up.labels(backend.url).set(1)
            logger.warning("re-admitted backend %s: its health check passes", backend.url)

    # ---- health checks ---------------------------------------------------------------------------
    async def probe(self, backend: Backend) -> bool:
        """One `GET /health`; its outcome applied to the backend."""
        failure = await self._health_failure(backend)
        if failure is None:
            self._passed_probe(backend)
            return True
        self.failed(backend, *failure)
        return False

    async def _health_failure(self, backend: Backend) -> tuple[str, str] | None:
        """None if /health answered 200 in time, else (error kind, why not)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.health_check_timeout)
        try:
            async with self.session.get(backend.url + "/health", headers=self.headers, timeout=timeout) as response:
                await response.read()
                return None if response.status == 200 else ("unhealthy", f"GET /health answered {response.status}")
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            return "connect", f"cannot connect: {exc}"
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError):
            return "timeout", f"GET /health did not answer within {self.settings.health_check_timeout:g} s"
        except aiohttp.ClientError as exc:
            return "disconnected", f"GET /health failed: {type(exc).__name__}: {exc}"

    async def probe_all_at_start(self) -> None:
        """Each backend's state before the first request: one probe each, side by side. A backend that
        fails it starts ejected (that is not counted as an ejection)."""
        results = await asyncio.gather(*(self._health_failure(b) for b in self.backends))
        for backend, failure in zip(self.backends, results, strict=True):
            if failure is not None:
                reason = failure[1]
                backend.up, backend.last_error = False, reason
                self.metrics.up.labels(backend.url).set(0)
                logger.warning("backend %s starts out of rotation: %s", backend.url, reason)

    async def _health_loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            await self.probe(backend)

    # ---- load ------------------------------------------------------------------------------------
    async def poll_load(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_check_timeout)
        try:
            async with self.session.get(backend.url + "/load", headers=self.headers, timeout=timeout) as response:
                body = await response.read()
                if response.status in (404, 405):
                    backend.polls_load, backend.load = False, None
                    logger.info("backend %s has no GET /load: it is balanced by in-flight counts", backend.url)
                    return
                backend.load = _decode_load(body) if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError):
            backend.load = None  # stale numbers would mislead: fall back to the in-flight count

    async def _load_loop(self, backend: Backend, interval: float) -> None:
        while True:
            if backend.up and backend.polls_load:
                await self.poll_load(backend)
            await asyncio.sleep(interval)

    # ---- running ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Probe every backend every health-check interval, and poll the load of those in rotation."""
        loop = asyncio.get_running_loop()
        interval = self.settings.load_poll_interval
        for backend in self.backends:
            backend._tasks.append(loop.create_task(self._health_loop(backend)))
            if interval:
                backend._tasks.append(loop.create_task(self._load_loop(backend, interval)))

    async def stop(self) -> None:
        tasks = [t for b in self.backends for t in b._tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for backend in self.backends:
            backend._tasks.clear()
