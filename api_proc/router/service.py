"""Running `pagoda router`: one process, one event loop.

Start-up: every backend is probed once (so the first request already avoids a dead one), then the
port opens, the health checks and load polls start, and systemd hears READY=1 (Type=notify). SIGTERM
or SIGINT: STOPPING=1, new requests get 503 and /health turns 503 (so a balancer in front stops
sending), in-flight requests get up to --shutdown-timeout to finish, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import aiohttp
from aiohttp import web

from pagoda.api_proc.http_guard import GuardedAppRunner, HttpGuard, allow_open_files
from pagoda.api_proc.router.backends import BackendPool
from pagoda.api_proc.router.metrics import RouterMetrics
from pagoda.api_proc.router.proxy import RouterProxy
from pagoda.api_proc.router.settings import RouterSettings
from pagoda.api_proc.sd_notify import Notifier

logger = logging.getLogger("pagoda.router")


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # No cookie jar: a cookie one backend sets must never ride along on another client's request.
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar()
    )


def _proxy_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """For the clients' requests. No cap on connections to backends (the client connection cap bounds
    them); idle ones close after --backend-keepalive-timeout (15 s), well before a Pagoda backend's 75 s
    keep-alive, so a reused one is rarely closed under us."""
    return _session(aiohttp.TCPConnector(limit=0, keepalive_timeout=settings.backend_keepalive_timeout))


def _probe_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """For the health probes and /load polls: one connection per backend. Sent through the proxy's pool
    they kept every idle connection of a past burst open: aiohttp hands out the oldest idle connection
    first and stamps it fresh, so a poll every 250 ms reached each of 60 connections within the 15 s
    keep-alive, and none ever expired."""
    return _session(
        aiohttp.TCPConnector(limit=0, limit_per_host=1, keepalive_timeout=settings.backend_keepalive_timeout)
    )


async def run_router(settings: RouterSettings) -> int:
    notifier = Notifier(os.environ.pop("NOTIFY_SOCKET", None))
    metrics = RouterMetrics(settings.backends)
    async with _proxy_session(settings) as session, _probe_session(settings) as probe_session:
        pool = BackendPool(settings, metrics, probe_session)
        await pool.probe_all_at_start()
        proxy = RouterProxy(settings, pool, metrics, session)
        guard = HttpGuard(
            header_timeout=settings.header_timeout,
            max_connections=allow_open_files(settings.max_connections, files_per_connection=2),
        )
        runner = GuardedAppRunner(
            proxy.app,
            guard,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=settings.keepalive_timeout,
            shutdown_timeout=1.0,  # our own drain below has waited already
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, settings.host, settings.port, backlog=2048).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
        pool.start()
        up = len(pool.up())
        logger.info(
            "routing http://%s:%d to %d backends (%d up), policy %s",
            settings.host,
            settings.port,
            len(settings.backends),
            up,
            settings.policy,
        )
        notifier.send("READY=1", f"STATUS=routing to {up} of {len(settings.backends)} backends")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Draining already: another signal changes nothing. (Left registered, the loop's close would
            # restore the default action, and one arriving then would kill the process mid-exit.)
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        notifier.send("STOPPING=1", "STATUS=draining")
        await _drain(proxy, settings.shutdown_timeout)
        await runner.cleanup()
        await pool.stop()
    return 0


async def _drain(proxy: RouterProxy, timeout: float) -> None:
    proxy.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proxy.active_requests and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if proxy.active_requests:
        logger.warning("shutdown timeout: closing %d unfinished requests", proxy.active_requests)
