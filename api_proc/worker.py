"""One HTTP worker process: the aiohttp server, obeying the `pagoda serve` parent.

The parent says "serve" (every process is ready: /health may turn 200), "drain" (stop accepting,
finish in-flight requests up to the shutdown timeout, exit 0) or "fail" (a sibling process died: end
every in-flight request with an error now, exit 1).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from multiprocessing.connection import Connection

from aiohttp import web

from pagoda.api_proc import metrics as api_metrics
from pagoda.api_proc.http_guard import GuardedAppRunner, HttpGuard, allow_open_files
from pagoda.api_proc.server import ApiServer, ApiSettings
from pagoda.engine_core.lifecycle import Command, ParentLink, Report, Role, freeze_startup_heap, init_child_process

logger = logging.getLogger(__name__)


async def _drain(server: ApiServer, timeout: float) -> None:
    server.draining = True
    deadline = time.monotonic() + timeout
    while server.active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if server.active_requests:
        logger.warning("shutdown timeout: ending %d unfinished requests", server.active_requests)
        server.client.fail_all("The server is shutting down.")
        await asyncio.sleep(0.2)


async def _serve(settings: ApiSettings, link: ParentLink | None) -> int:
    server = ApiServer(settings)
    guard = HttpGuard(
        header_timeout=settings.header_timeout, max_connections=allow_open_files(settings.max_connections)
    )
    runner = GuardedAppRunner(
        server.app, guard, handler_cancellation=True, access_log=None, keepalive_timeout=settings.keepalive_timeout
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_port=settings.reuse_port, backlog=2048)
    await site.start()
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    async def drain_then_exit() -> None:
        await _drain(server, settings.shutdown_timeout)
        if not done.done():
            done.set_result(0)

    async def fail_then_exit() -> None:
        server.draining = True
        server.client.fail_all("A server process has died; the server is restarting.")
        await asyncio.sleep(0.2)  # let handlers write their error responses
        if not done.done():
            done.set_result(1)

    tasks: set[asyncio.Task] = set()

    def on_command(command: Command) -> None:
        if command is Command.SERVE:
            server.serving = True
            if link is not None:  # /health can answer 200 from now on; the parent's READY=1 waits for this
                link.send(Report.SERVING)
        elif command is Command.DRAIN:
            tasks.add(loop.create_task(drain_then_exit()))  # held: the loop keeps only weak references
        elif command is Command.FAIL:
            tasks.add(loop.create_task(fail_then_exit()))

    freeze_startup_heap()
    if link is not None:
        link.watch(lambda command, info: loop.call_soon_threadsafe(on_command, command))
        link.send(Report.READY)
    else:  # run alone (tests, debugging): serve at once; signals drain
        server.serving = True
        loop.add_signal_handler(signal.SIGTERM, on_command, Command.DRAIN)
        loop.add_signal_handler(signal.SIGINT, on_command, Command.DRAIN)
    status = await done
    await runner.cleanup()
    server.client.close()
    return status


def run_api_worker(
    settings: ApiSettings, parent_conn: Connection | None = None, runtime_dir: str | None = None, worker: int = 0
) -> None:
    """Process entry point of HTTP worker number `worker` (its title: "pagoda: api <worker>")."""
    init_child_process(Role.API.process_name(), Role.API.process_title(worker))
    api_metrics.set_worker(worker)
    link = None
    if parent_conn is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which decides
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        link = ParentLink(parent_conn, runtime_dir)
    sys.exit(asyncio.run(_serve(settings, link)))
