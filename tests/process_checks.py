"""What the lifecycle tests check after kill -9 of `pagoda serve`: every process it started (children and
theirs: tensor-parallel workers are the engines' children) gone within 2 s, and nothing left behind:
runtime directories, the frontend socket, shared-memory segments, parallel groups' directories."""

from __future__ import annotations

import os
from pathlib import Path

from pagoda.api_proc.bench.local_server import PagodaServer, alive, child_pids, wait_until


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    found = []
    for child in child_pids(pid):
        found += [child, *descendants(child)]
    return found


def shared_memory_of(pids: list[int]) -> set[str]:
    """The /dev/shm entries these processes have open or mapped (other programs' are not our business)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            found |= {line.split()[-1] for line in maps if "/dev/shm/" in line}
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    found.add(target)
        except OSError:  # exited meanwhile
            continue
    return found


def kill_9_leaves_nothing(server: PagodaServer, group_dirs: Path | None = None) -> None:
    """kill -9 the server's parent process and assert that everything it started goes with it.
    `group_dirs`: the TMPDIR where parallel engines make their groups' directories (pagoda-tp-*)."""
    processes = descendants(server.process.pid)
    shm = shared_memory_of([server.process.pid, *processes])
    server.process.kill()
    server.process.wait()
    assert wait_until(lambda: not any(alive(pid) for pid in processes), 2.0), [
        Path(f"/proc/{p}/comm").read_text() for p in processes if alive(p)
    ]
    assert wait_until(lambda: server.runtime_dirs() == [], 1.0)
    assert not (server.tmp_path / "frontend.sock").exists()
    left = [path for path in shm if os.path.exists(path)]
    assert left == [], f"shared memory left behind: {left}"
    if group_dirs is not None:
        assert [p.name for p in group_dirs.iterdir() if p.name.startswith("pagoda-tp-")] == []
