"""`die_with_parent` (engine_core/lifecycle.py), which every child process calls first: a child whose parent
dies while it still imports (a replica restarting, a compile worker starting, when the server is killed) has
been handed to another process by then; told the pid that started it, it dies as soon as it arms, instead of
living on under its new parent."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# The child: imports for a while, then arms the parent-death signal naming the pid that started it.
_CHILD = """
import sys, time
time.sleep(0.5)  # (the imports, during which its parent dies)
from pagoda.engine_core.lifecycle import die_with_parent
die_with_parent(parent=int(sys.argv[1]) if sys.argv[1] != "-" else None)
time.sleep(60)
"""

# The parent: starts the child, says its pid, and exits at once.
_PARENT = """
import os, subprocess, sys
named = str(os.getpid()) if sys.argv[2] == "named" else "-"
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (the caller waits for its pipes' end)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], named], **quiet)
print(child.pid, flush=True)
"""


def _orphan(mode: str) -> int:
    """The pid of a child whose parent exited before the child armed (its parent pid `named` or not)."""
    done = subprocess.run([sys.executable, "-c", _PARENT, _CHILD, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_whose_parent_died_during_its_imports_dies_when_it_arms():
    pid = _orphan("named")
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_without_the_parent_s_pid_such_a_child_lives_on():
    """What the pid is for: the check against the current parent sees the one it was handed to."""
    pid = _orphan("unnamed")
    try:
        time.sleep(3)
        assert _alive(pid)
    finally:
        subprocess.run(["kill", "-9", str(pid)], check=False)
