"""A small pool of grammar compile workers (engine_core/grammar_worker.py): several compiles at once,
each under a time limit, each cancelled when nobody waits for it any more.

Why processes and not threads: xgrammar's compile cannot be interrupted (grammar_worker.py), so a
thread could only abandon a compile, which would keep its core and its memory until it ended on its
own; a few such compiles would fill any thread pool and hold every constrained request behind them
(issue 45: one 570 KB schema compiled for 17 minutes, took the engine from 3.2 to 5.4 GB, and a
one-line regex from another client timed out five times). A worker process that runs past the time
limit, or whose requests have all gone, is killed: its CPU and memory come back at once, and a fresh
worker takes its place. What this costs: each worker is a Python process with xgrammar imported
(~2.3 s of CPU to start, ~330 MB resident, much of it torch's libraries, which the engine maps too),
and a compiled grammar crosses the pipe as JSON (a typical schema's is 35 KB and adds ~10 ms; a
200-property schema's is 14 MB and adds ~1.3 s, in the worker and in this pool's thread, off the
engine loop). Workers start ahead of need at the lowest priority (`prestart`), and compile at the
normal one.

Scheduling: each worker compiles one spec at a time; queued specs go smallest first (the text's
length: a small spec never waits behind a big one that is queued, only behind ones already
running), and each compile is timed from the moment a worker takes it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgspec

from pagoda.engine_core.grammar_worker import HEADER, KIND_NAMES, SpecError, read_frame, write_frame
from pagoda.engine_core.structured_limits import COMPILE_TIMEOUT_FLAG

if TYPE_CHECKING:
    from pagoda.engine_core.grammar_backend import GrammarBackend

logger = logging.getLogger(__name__)
LOAD_NICENESS = 19  # workers started ahead of need import at this priority (see grammar_worker._load)


class CompileNotDone(SpecError):
    """The spec was not compiled (time limit, worker died): a refusal that is not cached, since the
    same spec may compile another time."""


class _Job:
    __slots__ = ("cancelled", "future", "key")

    def __init__(self, key: tuple[str, str]):
        self.key = key
        self.future: Future = Future()
        self.cancelled = False


class _Worker:
    """One worker process and the thread of this pool that drives it."""

    def __init__(self, index: int):
        self.index = index
        self.process: subprocess.Popen | None = None
        self.job: _Job | None = None  # the job it has taken
        self.compiling = False  # that job was sent to the process


class GrammarCompilePool:
    """`num_workers` compile workers for one backend (`backend()` returns it, loading it if need be).
    `timeout`: seconds one compile may run (None: no limit). Thread-safe; the engine thread calls
    `submit` and `cancel`."""

    def __init__(self, backend: Callable[[], GrammarBackend], num_workers: int = 2, timeout: float | None = 10.0):
        if num_workers < 1:
            raise ValueError("a grammar compile pool needs at least one worker")
        self._backend = backend
        self.timeout = timeout
        # xgrammar's own threads per compile: together the workers use half the cores at most, as the
        # one in-engine compiler did (the engine's threads need the rest).
        self._threads_per_compile = max(1, (os.cpu_count() or 2) // 2 // num_workers)
        self._lock = threading.Condition()
        self._queue: list[tuple[int, int, _Job]] = []  # (spec length, arrival, job): a heap
        self._arrivals = itertools.count()
        self._jobs: dict[Future, _Job] = {}  # queued or compiling
        self._workers = [_Worker(i) for i in range(num_workers)]
        self._threads: list[threading.Thread] = []
        self._closed = False
        # For tests and stats: grammars compiled, jobs cancelled (nobody waiting), compiles timed
        # out, and worker processes killed mid-compile (cancelled or timed out).
        self.num_compiles = 0
        self.num_cancelled = 0
        self.num_timed_out = 0
        self.num_killed = 0

    # ---- the engine thread's side ------------------------------------------------------------
    def submit(self, key: tuple[str, str]) -> Future:
        """Queue the spec `key` (kind, text); the future gets the compiled grammar, or SpecError."""
        job = _Job(key)
        with self._lock:
            self._start_threads(warm=False)
            heapq.heappush(self._queue, (len(key[1]), next(self._arrivals), job))
            self._jobs[job.future] = job
            self._lock.notify()
        return job.future

    def cancel(self, future: Future) -> None:
        """Nobody waits for `future` any more: drop its job if queued, kill its worker if compiling."""
        with self._lock:
            job = self._jobs.pop(future, None)
            if job is None or job.cancelled:
                return
            job.cancelled = True
            self.num_cancelled += 1
            for worker in self._workers:
                if worker.job is job and worker.compiling and worker.process is not None:
                    worker.process.kill()  # (its thread sees the pipe close, reaps it, takes the next job)
            # A queued job stays in the heap, skipped when it comes up.

    @property
    def num_compiling(self) -> int:
        """Specs a worker process is compiling now (sent to it, no answer yet)."""
        with self._lock:
            return sum(worker.compiling for worker in self._workers)

    def prestart(self) -> None:
        """Start every worker now, importing at the lowest priority, so the first compiles need not
        wait for a worker to start."""
        with self._lock:
            self._start_threads(warm=True)

    def close(self) -> None:
        """Stop the workers (their compiles are dropped) and reap them, so that an engine closed inside a
        longer-lived process (the offline `LLM`, tests) leaves no zombie behind."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            processes = [worker.process for worker in self._workers if worker.process is not None]
            for process in processes:
                process.kill()
        for process in processes:  # (outside the lock: a pool thread may be reaping it too)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)

    # ---- the pool's threads ------------------------------------------------------------------
    def _start_threads(self, warm: bool) -> None:  # (under the lock)
        if self._threads or self._closed:
            return
        for worker in self._workers:
            thread = threading.Thread(
                target=self._serve, args=(worker, warm), name=f"pagoda-grammar-{worker.index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _serve(self, worker: _Worker, warm: bool) -> None:
        if warm:
            try:
                self._spawn(worker, LOAD_NICENESS)
            except Exception:  # (retried with the first job, which then fails if it fails again)
                logger.exception("grammar compile worker %d failed to start", worker.index)
        while (job := self._next_job(worker)) is not None:
            try:
                self._run(worker, job)
            except Exception as exc:  # noqa: BLE001 - the backend or the worker failed: this request fails
                self._finish(worker, job, exc)
                continue
            if worker.process is None and not self._closed:  # killed: start its successor now, not
                try:  # when the next job (perhaps a small one that should not wait) comes
                    self._spawn(worker, 0)
                except Exception:
                    logger.exception("grammar compile worker %d failed to restart", worker.index)

    def _next_job(self, worker: _Worker) -> _Job | None:
        with self._lock:
            while True:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return None
                job = heapq.heappop(self._queue)[2]
                if not job.cancelled:
                    worker.job = job
                    return job

    def _run(self, worker: _Worker, job: _Job) -> None:
        backend = self._backend()
        if worker.process is None or worker.process.poll() is not None:
            self._reap(worker)
            self._spawn(worker, 0)
        process = worker.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        with self._lock:
            if job.cancelled:  # (while its worker started)
                return self._finish(worker, job, None)
            worker.compiling = True  # from now on `cancel` kills the process
        write_frame(process.stdin.fileno(), list(job.key))
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        reply = _read_frame_by(process.stdout.fileno(), deadline)
        if reply is None:  # past the time limit, or the process ended (killed by `cancel`, or crashed)
            timed_out = not job.cancelled and deadline is not None and time.monotonic() >= deadline
            process.kill()
            self._reap(worker)
            if timed_out or job.cancelled:
                self.num_killed += 1
                logger.warning(
                    "grammar compile of a %s (%d bytes) %s; its worker was killed",
                    KIND_NAMES[job.key[0]],
                    len(job.key[1]),
                    f"ran past the {self.timeout:g} s limit" if timed_out else "was cancelled: no request waits for it",
                )
            self.num_timed_out += timed_out
            return self._finish(worker, job, self._not_done(job, timed_out, process))
        ok, payload = reply
        if not ok:
            return self._finish(worker, job, SpecError(payload))
        return self._finish(worker, job, backend.xgr.CompiledGrammar.deserialize_json(payload, backend.info))

    def _not_done(self, job: _Job, timed_out: bool, process: subprocess.Popen) -> CompileNotDone:
        kind = KIND_NAMES[job.key[0]]
        if timed_out:
            return CompileNotDone(
                f"the {kind} took longer than {self.timeout:g} s to compile, this server's limit "
                f"({COMPILE_TIMEOUT_FLAG}); a smaller or simpler one may compile."
            )
        return CompileNotDone(f"the {kind} could not be compiled: the compiler process ended ({process.returncode}).")

    def _finish(self, worker: _Worker, job: _Job, outcome: object) -> None:
        """Hand `outcome` (a compiled grammar, or the exception) to the job's future, unless the job
        was cancelled (nobody is waiting)."""
        with self._lock:
            worker.job, worker.compiling = None, False
            self._jobs.pop(job.future, None)
        if job.cancelled:
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            self.num_compiles += 1
            job.future.set_result(outcome)

    def _spawn(self, worker: _Worker, niceness: int) -> None:
        """Start the worker's process and wait until it can compile."""
        backend = self._backend()
        process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.engine_core.grammar_worker", str(os.getpid())],  # (its parent)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        with self._lock:
            worker.process = process
            if self._closed:
                process.kill()
        assert process.stdin is not None and process.stdout is not None
        init = {"tokenizer_info": backend.info_json, "max_threads": self._threads_per_compile, "niceness": niceness}
        with contextlib.suppress(BrokenPipeError):
            write_frame(process.stdin.fileno(), init)
        if read_frame(process.stdout.fileno()) != [True, ""]:
            process.kill()
            self._reap(worker)
            if self._closed:  # (killed by `close` while it started: nothing to report)
                return
            raise RuntimeError(f"the grammar compile worker failed to start (exit code {process.returncode})")

    def _reap(self, worker: _Worker) -> None:
        process = worker.process
        if process is None:
            return
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with self._lock:
            if worker.process is process:
                worker.process = None


def _read_frame_by(fd: int, deadline: float | None) -> list | None:
    """The next frame from `fd`, or None if the pipe closes or `deadline` (monotonic) passes first."""
    header = _read_exact_by(fd, HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact_by(fd, HEADER.unpack(header)[0], deadline)
    return None if body is None else msgspec.msgpack.decode(body)


def _read_exact_by(fd: int, size: int, deadline: float | None) -> bytes | None:
    chunks, left = bytearray(), size
    while left:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], timeout)[0]:
            return None
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks += chunk
        left -= len(chunk)
    return bytes(chunks)
