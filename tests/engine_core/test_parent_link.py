"""A child's end of its control pipe when the parent dies: the clean-up runs once, whole, even when the pipe's
end (the watcher thread) and the parent-death signal (the main thread's handler) both report it at once.

The processes are real (spawned, with a real pipe and a real SIGTERM); what the clean-up releases is a file
that it writes to, slowly, so that a second clean-up would overlap the first."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

from pagoda.engine_core.lifecycle import ParentLink

RELEASE_S = 0.5  # long enough that the signal's handler and the watcher overlap


class _SlowRelease(ParentLink):
    """Releases like the local Ray cluster's link (which kills every process below it): start, work, end."""

    def __init__(self, conn, runtime_dir: str, journal: Path):
        super().__init__(conn, runtime_dir)
        self.journal = journal

    def release_when_orphaned(self) -> None:
        with self.journal.open("a") as f:
            f.write(f"start {threading.current_thread().name}\n")
        time.sleep(RELEASE_S)
        with self.journal.open("a") as f:
            f.write("end\n")


def _child(conn, runtime_dir: str, journal: str, ready) -> None:
    link = _SlowRelease(conn, runtime_dir, Path(journal))
    signal.signal(signal.SIGTERM, lambda signum, frame: link.orphaned())
    link.watch(lambda command, info: None)
    ready.set()
    while True:  # the main thread keeps working (the signal's handler runs here, between bytecodes)
        time.sleep(0.01)


def test_the_pipes_end_and_the_parent_death_signal_together_clean_up_once_then_exit(tmp_path):
    mp = multiprocessing.get_context("spawn")
    parent_end, child_end = mp.Pipe()
    runtime_dir = tmp_path / "runtime"
    runtime_dir.mkdir()
    journal = tmp_path / "journal"
    ready = mp.Event()
    child = mp.Process(target=_child, args=(child_end, str(runtime_dir), str(journal), ready), daemon=True)
    child.start()
    child_end.close()
    assert ready.wait(60)

    # What the death of `pagoda serve` does to a child that armed a parent-death signal: both at once.
    os.kill(child.pid, signal.SIGTERM)
    parent_end.close()
    child.join(30)

    assert child.exitcode == 0
    lines = journal.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("start ") and lines[1] == "end", lines
    assert not runtime_dir.exists()
