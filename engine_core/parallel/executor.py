"""Rank 0's side of tensor and pipeline parallel: it starts ranks 1..N-1, sends them every step, and stops them.

Rank 0 is the engine-core process itself (scheduler, sampler, everything as without parallelism). The
executor has the other ranks started (`WorkerRanks`, engine_core/parallel/ranks.py: child processes
under the `mp` backend, Ray actors under the Ray backend), joins the groups with them, and from then on
sends each step's inputs to them before running the step itself (`broadcast_step`, which the model
runner calls; `broadcast_head` under pipeline parallel). With T tensor-parallel ranks per stage and P
stages there are T x P ranks: rank r is tensor-parallel rank r % T of stage r // T.

Ranks on rank 0's machine get the steps through the shared-memory ring and meet at a file store; a stage
wholly on that machine all-reduces through shared memory. When the ranks span machines (Ray placed a
stage on another node), those ranks get the steps over tcp with CURVE (engine_core/parallel/
tcp_feed.py) and every rank meets at rank 0's TCPStore, gloo binding each node's address.

A worker that dies or hangs is noticed (a collective or transfer fails or times out, a step write times
out, or it is gone: `check_alive`) and raised as `WorkerDied`, which makes the engine report itself dead.
`close` stops the workers and removes the group's runtime directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time

import msgspec
from torch.distributed import Store

from pagoda.engine_core import cpu_binding
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.model_runner import LogitsRows
from pagoda.engine_core.parallel import shm_allreduce, step_message
from pagoda.engine_core.parallel.distributed import DEFAULT_TIMEOUT_S, TPGroup, host_store, init_groups
from pagoda.engine_core.parallel.pipeline import PipeLink
from pagoda.engine_core.parallel.ranks import ProcessRanks, WorkerDied, WorkerRanks
from pagoda.engine_core.parallel.shm_ring import RingPeerGone, RingReader, RingSpec, RingWriter
from pagoda.engine_core.parallel.tcp_feed import TcpFeedWriter
from pagoda.engine_core.parallel.worker import WorkerSpec
from pagoda.engine_core.step_inputs import StepInputs

logger = logging.getLogger(__name__)
__all__ = ["ParallelExecutor", "RingReader", "RingSpec", "WorkerDied"]

_STOP_GRACE_S = 2.0


class ParallelExecutor:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ranks: WorkerRanks | None = None,
    ):
        """Start the workers (child processes unless `ranks` says otherwise) and join the groups (this
        process is rank 0); `timeout_s` bounds every collective, transfer and step write."""
        self.tensor_parallel_size = config.tensor_parallel_size
        self.pipeline_parallel_size = config.pipeline_parallel_size
        self.world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        self.timeout_s = timeout_s
        self.ranks = ranks if ranks is not None else ProcessRanks()
        self.runtime_dir = tempfile.mkdtemp(prefix="pagoda-tp-")  # (mode 0700) the group's store and sockets
        self.ring: RingWriter | None = None  # the steps for the ranks on this machine
        self.feed: TcpFeedWriter | None = None  # and for those on other machines
        self._store: Store | None = None  # rank 0's TCPStore when the ranks span machines
        self._group: TPGroup | None = None
        self.pipe: PipeLink | None = None
        self._restore: tuple[set[int], int] | None = None
        self._started = False
        try:
            self._start(config, model_dir)
        except BaseException:
            self.close()
            raise

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        """The config rank `rank` runs with (its own GPU on CUDA)."""
        return self.ranks.rank_config(config, rank)

    def _start(self, config: EngineConfig, model_dir: str) -> None:
        import torch

        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        on_cpu = config.torch_device().type == "cpu"
        nodes = self.ranks.nodes(self.world_size)
        here = [node == nodes[0] for node in nodes]  # on rank 0's machine
        spans_machines = not all(here)
        cores = (
            cpu_binding.divide_own(config.cpu_threads_bind, self.world_size)
            if on_cpu and self.ranks.pins_cores
            else None
        )
        store: str
        if spans_machines:
            self._store, store = host_store(self.ranks.address(0), self.world_size, self.timeout_s)
        else:
            store = os.path.join(self.runtime_dir, "store")
        shm_paths: list[str | None] | None = None
        if on_cpu and tp > 1 and shm_allreduce.supported():
            shm_paths = []
            for stage in range(pp):
                if all(here[stage * tp : (stage + 1) * tp]):  # (shared memory: one machine's ranks only)
                    path = os.path.join(self.runtime_dir, f"allreduce{stage}")
                    shm_allreduce.create_file(path, tp)
                    shm_paths.append(path)
                else:
                    shm_paths.append(None)
        local = [rank for rank in range(1, self.world_size) if here[rank]]
        remote = [rank for rank in range(1, self.world_size) if not here[rank]]
        if local:
            self.ring = RingWriter(num_readers=len(local), runtime_dir=self.runtime_dir)
        if remote:
            self.feed = TcpFeedWriter(len(remote), self.ranks.address(0))
        specs = []
        for rank in range(1, self.world_size):
            ring_spec = tcp_feed = None
            if here[rank]:
                assert self.ring is not None
                ring_spec, index = msgspec.msgpack.encode(self.ring.spec), local.index(rank)
            else:
                assert self.feed is not None
                tcp_feed, index = msgspec.msgpack.encode(self.feed.specs[remote.index(rank)]), 0
            specs.append(
                WorkerSpec(
                    self.rank_config(config, rank),
                    model_dir,
                    rank,
                    tp,
                    pp,
                    store,
                    shm_paths,
                    ring_spec,
                    index,
                    tcp_feed,
                    cores[rank] if cores is not None else None,
                    self.runtime_dir,
                    os.getpid(),
                    self.ranks.address(rank) if spans_machines else None,
                )
            )
        self._started = True
        self.ranks.start(specs)
        if on_cpu:
            self._restore = (os.sched_getaffinity(0), torch.get_num_threads())
            cpu_binding.apply(cores[0] if cores is not None else None, config.num_threads)
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d; %s%s)%s",
            self.world_size,
            tp,
            pp,
            ("gloo, all-reduces through shared memory" if any(shm_paths or ()) else "gloo") if on_cpu else "nccl",
            f", on {len(set(nodes))} machines" if spans_machines else "",
            f", CPU cores per rank {cores}" if cores is not None else "",
        )
        device = self.rank_config(config, 0).torch_device()
        self._group, self.pipe = init_groups(
            0,
            tp,
            pp,
            self._store if self._store is not None else store,
            device,
            self.timeout_s,
            shm_paths,
            self._workers_alive,
            self.ranks.address(0) if spans_machines else None,
        )
        if self.ring is not None:  # (its readers attach before they join the groups)
            self.ring.release_name()

    def _workers_alive(self) -> bool:
        return self.ranks.first_dead() is None

    @property
    def group(self) -> TPGroup:
        """Rank 0's tensor-parallel group (the model runner's), while the executor is open."""
        assert self._group is not None, "the parallel executor is closed"
        return self._group

    def broadcast_step(self, step: StepInputs, rows: LogitsRows) -> None:
        """Send one step to every worker (the model runner calls this before it runs the step)."""
        self._broadcast(step_message.encode_step(step, rows))

    def broadcast_head(self) -> None:
        """Tell the workers that rank 0 now runs the LM head of its oldest step in flight (pipeline
        parallel: the first stage's other tensor-parallel ranks join it)."""
        self._broadcast(step_message.encode_head())

    def _broadcast(self, message: list[bytes | memoryview]) -> None:
        # A worker that died since the last step fails this one now (a waitpid per worker), rather
        # than after a write to a reader that will never read it times out.
        self.check_alive()
        try:
            self._write(message, self.timeout_s)
        except (TimeoutError, RingPeerGone) as exc:
            raise WorkerDied(f"a worker rank stopped reading steps: {exc}") from exc

    def _write(self, message: list[bytes | memoryview], timeout_s: float) -> None:
        if self.ring is not None:
            self.ring.write(message, timeout_s=timeout_s)
        if self.feed is not None:
            self.feed.write(message, timeout_s=timeout_s)

    def check_alive(self) -> None:
        """Raise WorkerDied if a worker is gone (the engine checks while it is idle)."""
        dead = self.ranks.first_dead()
        if dead is not None:
            raise WorkerDied(dead)

    def explain(self, exc: BaseException) -> WorkerDied | None:
        """After a failed step: WorkerDied naming the worker that is gone, if one is."""
        deadline = time.monotonic() + 1.0  # (its exit may lag the broken connection a little)
        while time.monotonic() < deadline:
            dead = self.ranks.first_dead()
            if dead is not None:
                return WorkerDied(str(dead))  # (the broken connection is its cause: `raise ... from`, logged)
            time.sleep(0.05)
        return None

    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after a grace period), release the group and
        remove its runtime directory; restores this process's CPU affinity and threads. Idempotent."""
        if self._started and self.ranks.first_dead() is None:
            with contextlib.suppress(Exception):
                self._write(step_message.encode_stop(), _STOP_GRACE_S)
        self.ranks.stop(_STOP_GRACE_S)
        if self._group is not None:
            self._group.close()
            self._group = None
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.feed is not None:
            self.feed.close()
            self.feed = None
        self._store = None
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._restore is not None:
            import torch

            affinity, threads = self._restore
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)
            self._restore = None
