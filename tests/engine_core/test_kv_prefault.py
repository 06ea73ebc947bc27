"""engine_core/kv_prefault.py: a CPU KV pool's pages are mapped by a background thread before blocks
need them, without changing a byte of what the engine has already written, and the thread lets go of
the pool when asked. Residency is read from the kernel (mincore), not from the thread's own account."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import time

import pytest
import torch

from pagoda.engine_core import kv_prefault
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE)")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_share(pool: torch.Tensor) -> float:
    """Share of the pool's whole pages that are resident."""
    low = -(-pool.data_ptr() // PAGE) * PAGE
    high = (pool.data_ptr() + pool.numel() * pool.element_size()) // PAGE * PAGE
    pages = (high - low) // PAGE
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(low, high - low, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(byte & 1 for byte in vector) / pages


def _fresh_pool(blocks: int) -> torch.Tensor:
    """[layers 4, 2, blocks, 16 tokens, 3 heads, 64] float32 (12 KiB blocks, 96 KiB per block over the
    layers), in a mapping of its own: fresh pages, where torch.empty may reuse a freed part of the heap
    that earlier tests made resident."""
    shape = (4, 2, blocks, 16, 3, 64)
    memory = mmap.mmap(-1, math.prod(shape) * 4)
    return torch.frombuffer(memory, dtype=torch.float32).view(shape)


def test_the_pool_becomes_resident_and_what_was_written_stays():
    pool = _fresh_pool(1_000)
    assert _resident_share(pool) < 0.05
    # Blocks the engine wrote before the thread reaches them (block 1 in every layer, the last block
    # of the last layer's values), and one written while it runs.
    pool[:, :, 1] = 7.0
    pool[-1, 1, -1] = -3.0
    job = kv_prefault.prefault(pool)
    pool[2, 0, 500] = 5.0
    assert job.done.wait(60) and job.populated
    assert _resident_share(pool) > 0.99
    assert torch.all(pool[:, :, 1] == 7.0) and torch.all(pool[-1, 1, -1] == -3.0) and torch.all(pool[2, 0, 500] == 5.0)
    job.stop()
    assert job.pool is None


def test_a_pool_that_does_not_fit_in_available_memory_is_left_to_fault_in(monkeypatch):
    monkeypatch.setattr(kv_prefault, "HEADROOM", 1 << 62)  # (the real MemAvailable, never enough beside it)
    pool = _fresh_pool(1_000)
    job = kv_prefault.prefault(pool)
    assert job.done.wait(60) and not job.populated
    assert _resident_share(pool) < 0.05


def test_stop_ends_the_thread_before_it_is_done():
    pool = _fresh_pool(20_000)  # 1.8 GiB: seconds of work
    job = kv_prefault.prefault(pool)
    job.stop()
    assert job.done.is_set() and not any(thread.is_alive() for thread in job._threads)
    assert not job.populated and _resident_share(pool) < 0.9


def test_several_threads_share_out_one_pool():
    pool = _fresh_pool(2_000)
    job = kv_prefault.KVPoolPrefault(pool, threads=3)
    assert job.done.wait(60) and job.populated and len(job._threads) == 3
    assert _resident_share(pool) > 0.99
    job.stop()


def test_no_thread_for_nothing_to_populate():
    assert kv_prefault.prefault(None) is None
    assert kv_prefault.prefault(torch.empty((2, 2, 0, 16, 1, 8))) is None


def test_an_engine_populates_its_pool_and_releases_it():
    engine = EngineCore(EngineConfig(num_kv_blocks=600, max_model_len=512))
    job = engine.runner.kv_prefault
    assert job is not None and engine.runner.wait_for_kv_pages(60) and job.done.is_set() and job.populated
    assert len(job._threads) == min(kv_prefault.MAX_THREADS, torch.get_num_threads())  # one per engine core
    assert _resident_share(engine.runner.kv_cache) > 0.99
    engine.runner.release_kv_cache()
    assert engine.runner.kv_prefault is None and job.pool is None


def test_the_warm_up_waits_a_while_for_the_pool_to_be_mapped(monkeypatch):
    """A server is ready with its pool mapped (engine.warm_up), unless mapping it takes longer than the
    wait allows. Each madvise call is slowed here (the host's first touch of memory, as on a big pool), so
    that the threads are still at work when the warm-up's request has run."""
    real = kv_prefault._madvise()

    def slow_madvise(*args):
        time.sleep(0.02)  # (600 calls on two threads: ~6 s, against a warm-up of well under one)
        return real(*args)

    monkeypatch.setattr(kv_prefault, "_madvise", lambda: slow_madvise)
    engine = EngineCore(EngineConfig(num_kv_blocks=600, max_model_len=512))  # 10 chunks x 60 regions
    job = engine.runner.kv_prefault
    assert job is not None
    engine.warm_up(kv_pages_wait=60.0)
    assert job.done.is_set() and job.populated and _resident_share(engine.runner.kv_cache) > 0.99
    engine.runner.release_kv_cache()

    engine = EngineCore(EngineConfig(num_kv_blocks=600, max_model_len=512))
    job = engine.runner.kv_prefault
    assert job is not None
    engine.warm_up(kv_pages_wait=0.0)  # (no wait: ready while the threads go on)
    assert not job.done.is_set()
    engine.runner.release_kv_cache()  # (stops them)
    assert job.done.is_set() and not job.populated
