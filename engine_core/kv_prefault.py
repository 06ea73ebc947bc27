"""Fault in a CPU KV pool's pages ahead of use, on a thread that runs only when a core is idle.

The pool is a `torch.empty` tensor, so the kernel maps its pages one fault at a time, when a block is
first written: inside a step, on the engine's critical path. A loaded server's steps keep meeting
fresh blocks until the whole pool has been used once (the free queue hands out never-used blocks
first), and each fault zeroes a page while the step's other thread waits at the next barrier. 128
requests of 128 -> 128 tokens at 64 at a time (SmolLM2, 2 GiB pool): offline, 335-340 output tokens/s
with the pool faulted in as used, 359-362 with it populated first; served, 8 s after ready, 332-338
against 349-357 (docs/decode-speed.md).

Populating it at start would cost start-up time (2.6-4.2 s for 2 GiB on this machine kind, whose
guest memory is slow to touch the first time); vLLM writes its whole pool with zeros before it is
ready. Here background threads ask the kernel instead, with `madvise(MADV_POPULATE_WRITE)` (Linux
5.14): it maps the pages writable without writing a byte, so it is safe while the engine writes
blocks, and a page already mapped is left as it is. The threads are SCHED_IDLE, so the engine's own
threads always come first; they work through the pool in block order, the order blocks are handed out,
a few MiB per call, so that each holds the address space's lock only briefly. One thread per engine
core (torch's thread count, at most MAX_THREADS): in this VM one thread mapped 2 GiB of fresh memory in
2.2-4.0 s, two in 0.3-0.9 s. The threads start when the pool is made, so they run beside the model's
warm-up, and the warm-up then waits for them a while (engine.KV_PAGES_BEFORE_READY): a fresh server's
2 GiB pool is mapped before it is ready, which that wait delays by ~0.3 s (docs/decode-speed.md).

Memory: the pool becomes resident as it would after a long run anyway. Where it would not fit in the
memory available now (the host's, or the cgroup's limit), nothing is populated and the pages keep
arriving as used, rather than the kernel's OOM killer choosing a process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
CHUNK_BLOCKS = 64  # blocks per call and region: ~768 KiB for SmolLM2's 12 KiB blocks
HEADROOM = 512 << 20  # bytes the host must keep free beside the pool for it to be populated
MAX_THREADS = 8  # (mapping pages is the kernel zeroing them: a few threads take all the memory bandwidth)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class KVPoolPrefault:
    """Populates `pool` ([layers, 2, blocks, ...] on the CPU, contiguous) on `threads` background threads
    (default: one per engine core, at most MAX_THREADS)."""

    def __init__(self, pool: torch.Tensor, threads: int | None = None):
        assert pool.device.type == "cpu" and pool.is_contiguous() and pool.dim() >= 3
        self.pool: torch.Tensor | None = pool
        self.done = threading.Event()  # set when every thread has stopped, populated or not
        self.populated = False
        self._stop = threading.Event()
        self._chunks = iter(range(0, pool.shape[2], CHUNK_BLOCKS))  # the first block of each, in order
        self._lock = threading.Lock()  # (taking the next chunk)
        self._failed = False
        self._madvise = _madvise()
        self._started = time.monotonic()
        if threads is None:
            threads = min(MAX_THREADS, torch.get_num_threads())
        count = max(1, threads) if self._can_populate() else 0
        self._running = count
        self._threads = [
            threading.Thread(target=self._run, name=f"pagoda-kv-prefault-{i}", daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()
        if not self._threads:
            self.done.set()

    def stop(self) -> None:
        """Stop after the current calls (a few milliseconds) and let go of the pool."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.pool = None

    def _can_populate(self) -> bool:
        """madvise is there, and the pool fits in the memory available with HEADROOM to spare."""
        pool = self.pool
        assert pool is not None
        if self._madvise is None:
            return False
        total, available = pool.numel() * pool.element_size(), available_memory()
        if available is not None and total > available - HEADROOM:
            logger.warning(
                "KV pool (%.2f GiB) not populated ahead of use: %.2f GiB of memory is available",
                total / 2**30,
                available / 2**30,
            )
            return False
        return True

    def _run(self) -> None:
        try:
            self._populate()
        except Exception:  # a background nicety: never the engine's failure
            logger.exception("populating the KV pool failed; its pages arrive as blocks are used")
            self._failed = True
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._finish()

    def _finish(self) -> None:
        pool = self.pool
        self.populated = not self._failed and not self._stop.is_set()
        if self.populated and pool is not None:
            logger.info(
                "KV pool (%.2f GiB) populated in %.1f s on %d threads",
                pool.numel() * pool.element_size() / 2**30,
                time.monotonic() - self._started,
                len(self._threads),
            )
        self.done.set()

    def _next_chunk(self) -> int | None:
        with self._lock:
            return next(self._chunks, None)

    def _populate(self) -> None:
        """Take chunks of blocks in order until none is left (or stop is asked, or a call fails)."""
        madvise, pool = self._madvise, self.pool
        assert madvise is not None and pool is not None  # (stop() lets go of the pool only after the threads)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (0: this thread)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: it still runs, at normal priority
        total = pool.numel() * pool.element_size()
        regions, blocks = pool.shape[0] * pool.shape[1], pool.shape[2]
        block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        region_bytes = blocks * block_bytes
        low, high = _round_up(pool.data_ptr()), (pool.data_ptr() + total) // _PAGE * _PAGE  # (whole pages only)
        while not self._stop.is_set() and not self._failed and (first := self._next_chunk()) is not None:
            count = min(CHUNK_BLOCKS, blocks - first)
            for region in range(regions):
                start = pool.data_ptr() + region * region_bytes + first * block_bytes
                begin, end = max(low, start // _PAGE * _PAGE), min(high, start + count * block_bytes)
                if end > begin and madvise(begin, end - begin, MADV_POPULATE_WRITE) != 0:
                    error = ctypes.get_errno()
                    logger.debug("MADV_POPULATE_WRITE failed (%s); KV pages arrive as used", os.strerror(error))
                    self._failed = True
                    return


def prefault(pool: torch.Tensor | None) -> KVPoolPrefault | None:
    """Start populating a CPU pool; None where there is nothing to do (another device, no pool)."""
    if pool is None or pool.device.type != "cpu" or pool.numel() == 0:
        return None
    return KVPoolPrefault(pool)


def available_memory() -> int | None:
    """Bytes that can still be made resident: the host's MemAvailable, or less under a cgroup limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:  # cgroup v2: "0::/path"
        path = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[1]
        group = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((group / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        pass
    return min(found) if found else None


def _round_up(address: int) -> int:
    return -(-address // _PAGE) * _PAGE


def _madvise():
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function
