"""Rank 0's side of tensor and pipeline parallel: it starts ranks 1..N-1, sends them every step, and stops them.

Rank 0 is the engine-core process itself (scheduler, sampler, everything as without parallelism);
`ParallelExecutor` starts one worker process per other rank (engine_core/parallel/worker.py,
multiprocessing "spawn", dying with this process), joins the groups with them, and from then on sends
each step's inputs through the broadcast ring before running the step itself (`broadcast_step`, which
the model runner calls; `broadcast_head` under pipeline parallel). With T tensor-parallel ranks per
stage and P stages there are T x P ranks: rank r is tensor-parallel rank r % T of stage r // T. A worker
that dies or hangs is noticed (a collective or transfer fails or times out, a ring write times out, or
its process is gone: `check_alive`) and raised as `WorkerDied`, which makes the engine report itself
dead. `close` stops the workers and removes the group's runtime directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import msgspec

from engine_core import cpu_binding
from engine_core.config import EngineConfig
from engine_core.lifecycle import Report
from engine_core.model_runner import LogitsRows, StepInputs
from engine_core.parallel import shm_allreduce, step_message
from engine_core.parallel.distributed import DEFAULT_TIMEOUT_S, TPGroup, init_groups
from engine_core.parallel.pipeline import PipeLink
from engine_core.parallel.shm_ring import RingPeerGone, RingReader, RingSpec, RingWriter
from engine_core.parallel.worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)
__all__ = ["ParallelExecutor", "RingReader", "RingSpec", "WorkerDied", "rank_config"]

_START_TIMEOUT_S = 120.0  # for a worker to start (spawn, imports) and report that it is joining
_STOP_GRACE_S = 2.0


class WorkerDied(RuntimeError):
    """A worker rank exited or stopped answering; the engine cannot go on."""


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config rank `rank` runs with: on CUDA each rank has its own GPU (cuda:rank, counted from the
    replica's first: the one --device names, offset by the data-parallel rank), counting every rank of
    every stage."""
    device = config.torch_device()
    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + rank}", data_parallel_rank=0)


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection


class ParallelExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Start the workers and join the groups (this process is rank 0); `timeout_s` bounds every
        collective, transfer and ring write."""
        mp = multiprocessing.get_context("spawn")
        if multiprocessing.current_process().daemon:
            raise RuntimeError(
                "tensor or pipeline parallel needs an engine process that may start children (not a daemonic one)"
            )
        self.tensor_parallel_size = config.tensor_parallel_size
        self.pipeline_parallel_size = config.pipeline_parallel_size
        self.world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        self.timeout_s = timeout_s
        self.runtime_dir = tempfile.mkdtemp(prefix="pagoda-tp-")  # (mode 0700) the group's store and sockets
        self.workers: list[_Worker] = []
        self.ring: RingWriter | None = None
        self._group: TPGroup | None = None
        self.pipe: PipeLink | None = None
        self._restore: tuple[set[int], int] | None = None
        try:
            self._start(mp, config, model_dir)
        except BaseException:
            self.close()
            raise

    def _start(self, mp, config: EngineConfig, model_dir: str) -> None:
        import torch

        on_cpu = config.torch_device().type == "cpu"
        cores = cpu_binding.divide_own(config.cpu_threads_bind, self.world_size) if on_cpu else None
        store = os.path.join(self.runtime_dir, "store")
        shm_paths = None
        if on_cpu and self.tensor_parallel_size > 1 and shm_allreduce.supported():
            shm_paths = [os.path.join(self.runtime_dir, f"allreduce{s}") for s in range(self.pipeline_parallel_size)]
            for path in shm_paths:
                shm_allreduce.create_file(path, self.tensor_parallel_size)
        self.ring = RingWriter(num_readers=self.world_size - 1, runtime_dir=self.runtime_dir)
        for rank in range(1, self.world_size):
            parent_end, child_end = mp.Pipe()
            spec = WorkerSpec(
                rank_config(config, rank),
                model_dir,
                rank,
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                store,
                shm_paths,
                msgspec.msgpack.encode(self.ring.spec),
                cores[rank] if cores is not None else None,
                self.runtime_dir,
            )
            process = mp.Process(
                target=run_worker,
                args=(spec, child_end),
                name=f"pagoda-tp{rank}",
                daemon=True,  # (ended by multiprocessing at exit if the engine is never closed)
            )
            process.start()
            child_end.close()
            self.workers.append(_Worker(rank, process, parent_end))
        self._wait_joining()
        if on_cpu:
            self._restore = (os.sched_getaffinity(0), torch.get_num_threads())
            cpu_binding.apply(cores[0] if cores is not None else None, config.num_threads)
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d; %s)%s",
            self.world_size,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            ("gloo, all-reduces through shared memory" if shm_paths else "gloo") if on_cpu else "nccl",
            f", CPU cores per rank {cores}" if cores is not None else "",
        )
        device = rank_config(config, 0).torch_device()
        self._group, self.pipe = init_groups(
            0,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            store,
            device,
            self.timeout_s,
            shm_paths,
            self._workers_alive,
        )

    def _workers_alive(self) -> bool:
        return all(w.process.is_alive() for w in self.workers)

    @property
    def group(self) -> TPGroup:
        """Rank 0's tensor-parallel group (the model runner's), while the executor is open."""
        assert self._group is not None, "the parallel executor is closed"
        return self._group

    def _wait_joining(self) -> None:
        """Wait until every worker is about to join the group, so that a worker that dies while starting
        is an error now rather than a rendezvous that waits for it until the timeout."""
        waiting = list(self.workers)
        deadline = time.monotonic() + _START_TIMEOUT_S
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

    def broadcast_step(self, step: StepInputs, rows: LogitsRows) -> None:
        """Send one step to every worker (the model runner calls this before it runs the step)."""
        self._broadcast(step_message.encode_step(step, rows))

    def broadcast_head(self) -> None:
        """Tell the workers that rank 0 now runs the LM head of its oldest step in flight (pipeline
        parallel: the first stage's other tensor-parallel ranks join it)."""
        self._broadcast(step_message.encode_head())

    def _broadcast(self, message: list[bytes | memoryview]) -> None:
        assert self.ring is not None
        # A worker that died since the last step fails this one now (a waitpid per worker), rather
        # than after a write to a reader that will never read it times out.
        self.check_alive()
        try:
            self.ring.write(message, timeout_s=self.timeout_s)
        except (TimeoutError, RingPeerGone) as exc:
            raise WorkerDied(f"a worker rank stopped reading steps: {exc}") from exc

    def check_alive(self) -> None:
        """Raise WorkerDied if a worker process is gone (the engine checks while it is idle)."""
        for worker in self.workers:
            if not worker.process.is_alive():
                raise WorkerDied(self._describe(worker))

    def explain(self, exc: BaseException) -> WorkerDied | None:
        """After a failed step: WorkerDied naming the worker that is gone, if one is."""
        deadline = time.monotonic() + 1.0  # (its exit may lag the broken connection a little)
        while time.monotonic() < deadline:
            for worker in self.workers:
                if not worker.process.is_alive():
                    return WorkerDied(f"{self._describe(worker)} ({type(exc).__name__}: {exc})")
            time.sleep(0.05)
        return None

    def _describe(self, worker: _Worker) -> str:
        code = worker.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if self.pipeline_parallel_size == 1:
            name = f"tensor-parallel rank {worker.rank}"
        else:
            stage, tp_rank = divmod(worker.rank, self.tensor_parallel_size)
            name = f"rank {worker.rank} (pipeline stage {stage + 1}, tensor-parallel rank {tp_rank})"
        return f"{name} (pid {worker.process.pid}) {how}"

    def close(self) -> None:
        """Stop the workers (a stop message, then SIGKILL after a grace period), release the group and
        remove its runtime directory; restores this process's CPU affinity and threads. Idempotent."""
        if self.ring is not None and all(w.process.is_alive() for w in self.workers):
            with contextlib.suppress(Exception):
                self.ring.write(step_message.encode_stop(), timeout_s=_STOP_GRACE_S)
        deadline = time.monotonic() + _STOP_GRACE_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(_STOP_GRACE_S)
            worker.conn.close()
        self.workers = []
        if self._group is not None:
            self._group.close()
            self._group = None
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._restore is not None:
            import torch

            affinity, threads = self._restore
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)
            self._restore = None
