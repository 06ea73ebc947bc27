"""detok_proc/metrics_cache.py on its own: renders happen on their own thread, never in the caller's (the
tokenizer process's loop), once for every query of an interval; and a query never gets a text rendered
longer than the interval before it asked. (Through a real server: tests/api_proc/test_metrics.py.)"""

from __future__ import annotations

import select
import threading

from pagoda.detok_proc.metrics_cache import MetricsCache


class Renders:
    """A render function that says which thread ran it, and can be held until released."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.started = threading.Event()  # set when a render has begun
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> bytes:
        self.threads.append(threading.current_thread())
        self.started.set()
        self.release.wait()
        return f"render {len(self.threads)}".encode()


def _collect(cache: MetricsCache) -> tuple[list, bytes | None]:
    """What the loop does when the cache's pipe turns readable (waits for it, as the loop's poll does)."""
    select.select([cache.fileno()], [], [])
    waiters, text, error = cache.finished()
    assert error is None
    return waiters, text


def test_every_query_of_an_interval_shares_one_render_made_off_the_callers_thread():
    renders = Renders()
    cache = MetricsCache(renders, interval=3600)
    try:
        assert [cache.get(i) for i in range(50)] == [None] * 50  # nothing rendered yet: all wait
        waiters, text = _collect(cache)
        assert sorted(waiters) == list(range(50)) and text == b"render 1"
        assert [cache.get(i) for i in range(50)] == [b"render 1"] * 50  # answered from the text, at once
        assert len(renders.threads) == 1 and renders.threads[0] is not threading.current_thread()
    finally:
        cache.close()


def test_with_interval_zero_a_query_during_a_render_waits_for_the_next_one():
    renders = Renders()
    cache = MetricsCache(renders, interval=0)
    try:
        renders.release.clear()  # the first render is held: "late" asks while it runs
        assert cache.get("early") is None
        assert renders.started.wait(30)
        assert cache.get("late") is None
        renders.release.set()
        waiters, text = _collect(cache)
        assert (waiters, text) == (["early"], b"render 1")  # began before "late" asked: not for it
        waiters, text = _collect(cache)
        assert (waiters, text) == (["late"], b"render 2")
        assert cache.get("again") is None  # interval 0: never answered from an old text
        assert _collect(cache) == (["again"], b"render 3")
    finally:
        cache.close()
