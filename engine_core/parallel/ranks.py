"""Where ranks 1..N-1 of a tensor/pipeline-parallel engine run, and how rank 0 starts, watches and stops them.

`ProcessRanks` (the `mp` backend): child processes of the engine core, on its machine, pinned to its
cores. `RayRanks` (engine_core/parallel/ray_ranks.py, the Ray backend): actors in the replica's
placement group, possibly on other nodes. The executor asks where each rank runs (`nodes`), gives each
rank a WorkerSpec that fits (shared memory for the ranks on rank 0's node, tcp for the others), and
`start`s them.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Protocol

import msgspec

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.lifecycle import Report
from pagoda.engine_core.parallel.worker import WorkerSpec, run_worker

START_TIMEOUT_S = 120.0  # for a rank to start (a process: spawn, imports) and be about to join


class WorkerDied(RuntimeError):
    """A worker rank exited or stopped answering; the engine cannot go on. Its message (which rank, how)
    is written for operators and clients alike (`core_proc.dead_message`)."""

    client_safe = True


class WorkerRanks(Protocol):
    pins_cores: bool  # whether rank 0 divides its own CPU cores among the ranks

    def nodes(self, world_size: int) -> list[str]:
        """The node of every rank, rank 0's first (ranks on rank 0's node share memory with it)."""
        ...

    def address(self, rank: int) -> str:
        """The address of rank `rank`'s node, as the other nodes reach it."""
        ...

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig: ...

    def start(self, specs: list[WorkerSpec]) -> None:
        """Start ranks 1..N-1 (specs in rank order); return once each is about to join the groups, or
        raise WorkerDied."""
        ...

    def first_dead(self) -> str | None:
        """What happened to a rank that is gone (None while all live)."""
        ...

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to exit (they were told to stop), then kill the rest."""
        ...


def rank_name(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    if pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    return f"rank {rank} (pipeline stage {stage + 1}, tensor-parallel rank {tp_rank})"


@dataclass
class _Worker:
    rank: int
    name: str
    process: multiprocessing.process.BaseProcess
    conn: Connection


class ProcessRanks:
    """Each rank a "spawn" child process of the engine core, dying with it (the parent-death signal and
    the pipe, engine_core/parallel/worker.py)."""

    pins_cores = True

    def __init__(self) -> None:
        self.workers: list[_Worker] = []

    def nodes(self, world_size: int) -> list[str]:
        return ["this machine"] * world_size

    def address(self, rank: int) -> str:
        return "127.0.0.1"

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        """On CUDA each rank has its own GPU: cuda:rank counted from the replica's first (the one
        --device names, offset by the data-parallel rank), counting every rank of every stage."""
        device = config.torch_device()
        if device.type != "cuda":
            return config
        return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + rank}", data_parallel_rank=0)

    def start(self, specs: list[WorkerSpec]) -> None:
        if multiprocessing.current_process().daemon:
            raise RuntimeError(
                "tensor or pipeline parallel needs an engine process that may start children (not a daemonic one)"
            )
        mp = multiprocessing.get_context("spawn")
        for spec in specs:
            parent_end, child_end = mp.Pipe()
            process = mp.Process(
                target=run_worker,
                args=(spec, child_end),
                name=f"pagoda-tp{spec.rank}",
                daemon=True,  # (ended by multiprocessing at exit if the engine is never closed)
            )
            process.start()
            child_end.close()
            name = rank_name(spec.rank, spec.tensor_parallel_size, spec.pipeline_parallel_size)
            self.workers.append(_Worker(spec.rank, name, process, parent_end))
        self._wait_joining()

    def _wait_joining(self) -> None:
        """Wait until every worker is about to join the group, so that a worker that dies while starting
        is an error now rather than a rendezvous that waits for it until the timeout."""
        waiting = list(self.workers)
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            events = [w.conn for w in waiting] + [w.process.sentinel for w in waiting]
            if not wait(events, timeout=max(0.0, deadline - time.monotonic())):
                raise WorkerDied(f"parallel ranks {[w.rank for w in waiting]} did not start")
            for worker in list(waiting):
                if worker.conn.poll():
                    try:
                        kind, _ = msgspec.msgpack.decode(worker.conn.recv_bytes())
                    except (EOFError, OSError):  # its end closed: it is exiting
                        kind = None
                    if kind == Report.READY.value:
                        waiting.remove(worker)
                        continue
                    worker.process.join(1.0)
                    raise WorkerDied(f"{self._describe(worker)} while starting")
                if not worker.process.is_alive():
                    raise WorkerDied(f"{self._describe(worker)} while starting")

    def first_dead(self) -> str | None:
        for worker in self.workers:
            if not worker.process.is_alive():
                return self._describe(worker)
        return None

    def _describe(self, worker: _Worker) -> str:
        code = worker.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"{worker.name} (pid {worker.process.pid}) {how}"

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(grace_s)
            worker.conn.close()
        self.workers = []
