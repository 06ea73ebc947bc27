"""systemd integration of `pagoda serve`: readiness, stopping and a watchdog tied to the engine loop.

The protocol (systemd's sd_notify(3) and sd_watchdog_enabled(3)), implemented here without a
dependency:

- `$NOTIFY_SOCKET` names an AF_UNIX datagram socket: a filesystem path, or an abstract-namespace name
  when it starts with "@" (the "@" stands for the leading NUL byte). Unset: not run by systemd with
  `Type=notify`, and every call here is a no-op. (Newer systemd also allows `vsock:` addresses; those
  are not supported and only logged.)
- One datagram carries newline-separated `KEY=VALUE` assignments: `READY=1` (start-up finished),
  `STOPPING=1` (shutdown began), `WATCHDOG=1` (keep-alive), `STATUS=...` (shown by `systemctl status`).
- `$WATCHDOG_USEC` is the `WatchdogSec=` period in microseconds; if `$WATCHDOG_PID` is set, only that
  process is meant to ping. The manager runs the watchdog only while the unit is starting-post,
  running or reloading (systemd's src/core/service.c, SERVICE_STATE_WITH_WATCHDOG): none is expected
  before READY=1 nor after STOPPING=1. With the default `NotifyAccess=main`, messages count only from
  the main process: the `pagoda serve` parent, so ExecStart= must run `pagoda` itself (or `exec` it).
- The variables are removed from our environment once read (like `sd_notify(unset_environment=1)`),
  so the child processes never talk to systemd themselves.

The watchdog must mean "the engine loop is alive", not "this process is alive" or "HTTP answers".
The parent learns that from the tokenizer process, which already times every message the engine
sends (one per step, and a heartbeat every idle second): `EngineWatchdog` asks it for a health report
over the frontend socket every half period and pings only if the report is healthy (the same stall
test as /health, `--engine-stall-timeout`) and the engine's last message is younger than 3/4 of the
period. So a stopped or hung engine loop (or a hung tokenizer process, which then cannot answer) stops
the pings within 3/4 of a period, and systemd acts one period after the last ping, while short gaps
(a slow answer, one late heartbeat) cost one ping at most. This needs nothing new from the engine or
the tokenizer process (no shared memory, no extra messages) and cannot disagree with /health.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

logger = logging.getLogger("pagoda.systemd")
_ENGINE_HEARTBEAT_S = 1.0  # engine_core/core_proc.py sends at least one message a second when idle
_MAX_HEALTH_WAIT_S = 5.0  # the tokenizer process answers in milliseconds; bounds how long stop() may wait


class Notifier:
    """Sends sd_notify messages to the socket `$NOTIFY_SOCKET` named at construction."""

    def __init__(self, address: str | None):
        self.address = address
        if address and not address.startswith(("/", "@")):
            logger.warning("NOTIFY_SOCKET=%s is not a unix socket address; not notifying systemd", address)
            self.address = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=VALUE` lines as one datagram; False if not under systemd or the send failed."""
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(assignments).encode(), target)
        except OSError as exc:  # systemd gone or socket unwritable: never fatal for the server
            logger.warning("cannot notify systemd at %s: %s", self.address, exc)
            return False
        return True


def watchdog_period(environ: dict[str, str], pid: int) -> float | None:
    """The watchdog period in seconds from `$WATCHDOG_USEC`, or None if disabled or meant for
    another process (`$WATCHDOG_PID`), as sd_watchdog_enabled(3) decides."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    watchdog_pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (watchdog_pid is not None and watchdog_pid != str(pid)):
        return None
    return usec / 1e6


class EngineWatchdog:
    """A daemon thread that sends `WATCHDOG=1` every `period / 2` while the engine loop makes progress
    (see the module docstring); `stop()` ends it before `STOPPING=1` is sent."""

    def __init__(self, notifier: Notifier, frontend_addr: str, period_s: float):
        self.notifier = notifier
        self.frontend_addr = frontend_addr
        self.interval_s = period_s / 2
        self.window_s = period_s * 3 / 4  # shorter than the period, longer than the engine's heartbeat gap
        if self.window_s < _ENGINE_HEARTBEAT_S * 1.5:
            logger.warning(
                "WatchdogSec=%.1fs is too short for the engine's %.0fs idle heartbeat; pings may be "
                "missed (use 10s or more)",
                period_s,
                _ENGINE_HEARTBEAT_S,
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the pings; returns once no further ping can be sent (within a health query's wait)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def engine_is_progressing(self, client) -> tuple[bool, str]:
        """(ping?, why) from one health report of the tokenizer process."""
        try:
            report = client.health(timeout=min(self.interval_s / 2, _MAX_HEALTH_WAIT_S))
        except TimeoutError:
            return False, "the tokenizer process does not answer"
        except Exception as exc:  # noqa: BLE001 - whatever broke, no proof of progress: no ping
            return False, f"health query failed: {type(exc).__name__}: {exc}"
        if not report.healthy:
            return False, report.message
        silence = report.seconds_since_engine_progress
        if silence >= self.window_s:
            return False, f"engine loop made no progress for {silence:.1f}s"
        return True, "ok"

    def _run(self) -> None:
        from pagoda.api_proc.client import EngineClient

        client = EngineClient(self.frontend_addr)
        withheld = False
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                alive, why = self.engine_is_progressing(client)
                if self._stop.is_set():  # stopping began while we asked: no ping after STOPPING=1
                    break
                if alive:
                    self.notifier.send("WATCHDOG=1")
                    if withheld:
                        logger.info("engine loop progressing again; watchdog pings resumed")
                        self.notifier.send("STATUS=serving")
                elif not withheld:
                    logger.warning("withholding systemd watchdog pings: %s", why)
                    self.notifier.send(f"STATUS=unhealthy: {why}")
                withheld = not alive
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            client.close()


class SystemdService:
    """What `pagoda serve` tells systemd, in the order it happens; every method is a no-op when the
    server does not run under systemd (`$NOTIFY_SOCKET` unset)."""

    def __init__(self, environ: dict[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self.notifier = Notifier(environ.get("NOTIFY_SOCKET"))
        self.period_s = watchdog_period(environ, os.getpid())
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # not for the children
            environ.pop(name, None)
        self.watchdog: EngineWatchdog | None = None

    def status(self, text: str) -> None:
        self.notifier.send(f"STATUS={text}")

    def ready(self, status: str, frontend_addr: str) -> None:
        """Start-up is complete (/health answers 200): READY=1, then watchdog pings if enabled."""
        if not self.notifier.enabled:
            return
        self.notifier.send("READY=1", f"STATUS={status}")
        if self.period_s is not None:
            self.watchdog = EngineWatchdog(self.notifier, frontend_addr, self.period_s)
            self.watchdog.start()
            logger.info(
                "systemd watchdog: a ping every %.1fs while the engine loop progresses", self.watchdog.interval_s
            )

    def stopping(self, status: str) -> None:
        """A requested shutdown began: pings end, then STOPPING=1."""
        self.close()
        self.notifier.send("STOPPING=1", f"STATUS={status}")

    def failed(self, status: str) -> None:
        """The server is failing on its own (a child died): pings end and the status says why; the
        non-zero exit that follows is what makes systemd restart it (Restart=on-failure)."""
        self.close()
        self.status(status)

    def close(self) -> None:
        """Stop the watchdog thread (idempotent); used on every exit path."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
