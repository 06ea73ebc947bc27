"""The /metrics text, rendered at most once per interval and never on the tokenizer process's loop.

Rendering reads /proc for every process and formats every series: milliseconds of work that, done for
each GET /metrics inside the poll loop, held up every other request's tokens (a flood of scrapes on the
public /metrics starved generation). So the loop never renders. A query is answered from the latest text
while that is younger than the interval; otherwise it waits for the next render, which runs on a thread
of its own (background.py) and answers every query that arrived meanwhile. A flood then costs the loop
one send per query, and the server one render per interval. The contract: a query gets a text whose
render began at most `interval` seconds before the query arrived (with 0, after it arrived).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from pagoda.detok_proc.background import BackgroundWork

Waiter = TypeVar("Waiter")
DEFAULT_INTERVAL = 1.0  # seconds: far below any scrape interval, so Prometheus never sees a cached text


class MetricsCache(Generic[Waiter]):
    def __init__(self, render: Callable[[], bytes], interval: float = DEFAULT_INTERVAL):
        """`render()` runs on the render thread: what it reads must be safe to read beside the loop
        (prometheus-client's metrics lock; the collectors copy what they iterate)."""
        self._render = render
        self.interval = interval
        self._thread = BackgroundWork("pagoda-metrics")
        self._text: bytes | None = None
        self._rendered_at = -math.inf  # time.monotonic() when the latest text's render began
        self._waiters: list[tuple[float, Waiter]] = []  # (arrival, waiter)
        self._rendering = False

    def fileno(self) -> int:
        """Readable when a render has finished: then call `finished()`."""
        return self._thread.fileno()

    def get(self, waiter: Waiter) -> bytes | None:
        """The latest text if it is fresh; else None, and `waiter` comes back from `finished()` with the
        next render's text (one render at a time, shared by every waiter)."""
        now = time.monotonic()
        if self._text is not None and now - self._rendered_at < self.interval:
            return self._text
        self._waiters.append((now, waiter))
        self._start()
        return None

    def _start(self) -> None:
        if not self._rendering:
            self._rendering = True
            self._thread.submit("render", self._timed_render)

    def finished(self) -> tuple[list[Waiter], bytes | None, BaseException | None]:
        """(waiters, text, error) of the render that finished: every waiter gets the text, or the error."""
        done = self._thread.finished()
        if not done:
            return [], None, None
        self._rendering = False
        _, result, error = done[-1]
        if error is not None:
            waiters, self._waiters = self._waiters, []
            return [waiter for _, waiter in waiters], None, error
        self._rendered_at, self._text = result  # type: ignore[misc]
        # Queries that came too long after this render began wait for the next one.
        served = [waiter for arrival, waiter in self._waiters if arrival - self.interval <= self._rendered_at]
        self._waiters = [(arrival, w) for arrival, w in self._waiters if arrival - self.interval > self._rendered_at]
        if self._waiters:
            self._start()
        return served, self._text, None

    def _timed_render(self) -> tuple[float, bytes]:
        began = time.monotonic()
        return began, self._render()

    def close(self) -> None:
        self._thread.close()
