"""Slow tokenizer work (long prompts) on a thread of its own, so the tokenizer process's poll loop
keeps routing every other request's deltas while it runs.

The tokenizers library releases the GIL while it encodes or decodes (measured: a 1.2 M-character
encode left the loop thread at full speed), so one worker thread is enough to take the work off the
loop. Finished jobs are handed back through a queue, and a byte written to a pipe wakes the loop's
`zmq.Poller`, which watches the pipe beside its sockets. After each job the C heap's freed pages go
back to the system (`malloc_trim`): a long prompt's temporary buffers would otherwise stay in the
process's RSS for good.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Hashable

from pagoda.engine_core.host_memory import release_freed_memory


class BackgroundWork:
    """One worker thread running submitted callables in order; results are collected by the loop."""

    def __init__(self, name: str = "pagoda-tokenize"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque = collections.deque()
        self._cancelled: set[Hashable] = set()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when finished jobs are waiting (register it with the loop's poller)."""
        return self._wake_read

    def submit(self, key: Hashable, job: Callable[[], object]) -> None:
        self._cancelled.discard(key)
        self._jobs.put((key, job))

    def cancel(self, key: Hashable) -> None:
        """Skip the job if it has not started; a running one finishes and is collected as usual."""
        self._cancelled.add(key)

    def finished(self) -> list[tuple[Hashable, object, BaseException | None]]:
        """(key, result, error) of every job finished since the last call, cancelled ones left out;
        never blocks."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._done:
            key, result, error = self._done.popleft()
            if key in self._cancelled:  # cancelled while it ran
                self._cancelled.discard(key)
            else:
                out.append((key, result, error))
        return out

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            key, job = item
            if key in self._cancelled:
                self._cancelled.discard(key)
                continue
            try:
                result, error = job(), None
            except Exception as exc:  # noqa: BLE001 - handed to the loop, which answers the client
                result, error = None, exc
            self._done.append((key, result, error))
            release_freed_memory()  # the tokenizer's temporary buffers of this job are freed by now
            os.write(self._wake_write, b"\0")

    def close(self) -> None:
        """Drop the jobs not started and stop the thread; a job still running is not waited for long
        (the process is exiting), and then the pipe stays open for it to write to."""
        try:
            while True:
                self._jobs.get_nowait()
        except queue.Empty:
            pass
        self._jobs.put(None)
        self._thread.join(timeout=0.2)
        if not self._thread.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)
