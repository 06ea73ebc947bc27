"""engine_core/host_memory.py: once set, a step's large blocks (above glibc's 32 MiB ceiling for its own
threshold, as a long prefill's are), allocated and freed step after step, reuse the heap's pages
instead of coming back as fresh pages one page fault each, and the heap stops growing once it holds a
step's working set. Each way in a fresh process, since the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import ctypes, resource, sys, torch
from pagoda.engine_core.host_memory import keep_freed_memory
# Pages of 4 KiB whatever the machine's transparent-huge-page setting: with THP "always", fresh mappings
# fault in 2 MiB at a time, and the default's cost would not show in the count (PR_SET_THP_DISABLE).
assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_mib(): return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
def block(mib): return torch.empty(mib << 18, dtype=torch.float32).fill_(1.0)
for step in range(24):  # a step's activations, in the interleaved order a forward frees them
    if step == 12:
        faults_then, rss_then = faults(), rss_mib()
    up, gate, small = block(96), block(40), block(1)
    del up
    down = block(60)
    del gate, small, down
print(faults() - faults_then, rss_mib() - rss_then)
"""


def _last_twelve_steps(mode: str) -> tuple[int, int]:
    """(minor page faults, RSS growth in MiB) over the last 12 of 24 steps."""
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    faults, growth = done.stdout.strip().splitlines()[-1].split()
    return int(faults), int(growth)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_large_blocks_are_reused_without_page_faults_and_the_heap_stops_growing():
    faults, growth = _last_twelve_steps("keep")
    assert faults < 2_000
    assert growth < 16
    # What the setting removes: every page of every block faulted again (12 steps x ~50,000 pages).
    assert _last_twelve_steps("default")[0] > 100_000
