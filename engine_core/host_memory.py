"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

glibc's malloc serves large blocks (above a threshold that it raises up to 32 MiB as they are freed)
with `mmap` and returns them on free, and trims the top of its heap back to the kernel when enough is
free there. A step's activations are exactly such blocks, allocated and freed every step: each new
one came back as fresh pages, zeroed by the kernel one page fault at a time. A 2,048-token prefill of
SmolLM2 took ~300,000 minor faults (1.2 GB of fresh pages) and 1.95-2.05 s; with freed memory kept,
23,000-45,000 faults and 1.67-1.70 s (the rest: first touches of the KV pool, once per page).

`keep_freed_memory` raises both thresholds, so a step's blocks come from the heap and go back to it; the
heap then stays at the largest step's working set, which the next such step needs again. The engine
sets them before the model loads: set after it, they changed nothing measurable (still ~300,000
faults), the heap apparently unable to grow in place past what the load had mapped. The cost, measured
with SmolLM2: +36 MiB of RSS after the load, +51 MiB after two 2,048-token prefills (1.27 -> 1.32 GiB).
The heap may hold a few freed blocks beside the ones in use (an aligned request does not fit a freed
block of its own size until neighbours coalesce), then stops growing: `soak.py --requests 1000` grew
the engine by 75 MiB (5 %) against 43 MiB without; tests/engine_core/test_host_memory.py checks both.
Other C libraries (musl) have no `mallopt`: nothing changes there.

Processes that only now and then build something large (the tokenizer process's long prompts, the HTTP
worker's large embedding replies) do the opposite, `release_freed_memory` after it: without it their
RSS stays at the largest such peak for good.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # larger blocks are still mapped (and returned) one by one
TRIM_THRESHOLD = 512 << 20  # free memory kept at the top of the heap


_libc_name = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_libc_name), "malloc_trim", None) if _libc_name else None


def release_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim`; a no-op elsewhere)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (process-wide); True if they were set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.debug("mallopt refused the thresholds; freed memory goes back to the kernel as before")
    return done
