"""A worker: the process holding rank 1..N-1 of a tensor- and/or pipeline-parallel model, started by the engine core.

It joins the groups, loads its shard of the model and KV cache (the same `ModelRunner` as rank 0: its
tensor-parallel slice of its pipeline stage's layers), then follows rank 0: each step message from the
ring runs the same forward pass (`ModelRunner.follow`), each head message joins rank 0's LM head
(`follow_head`), until a stop message. It exits with its parent (parent-death signal and the parent
pipe, engine_core/lifecycle.py), removing the group's runtime directory if the parent could not, and
after any error (exit 1; rank 0's next collective or transfer then fails and the engine reports itself
dead).

Nothing here imports torch at module level: a worker pins its CPU threads before torch starts any.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from pagoda.engine_core import cpu_binding
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.host_memory import keep_freed_memory
from pagoda.engine_core.lifecycle import ParentLink, Report, freeze_startup_heap, init_child_process

logger = logging.getLogger(__name__)
_READ_POLL_S = 1.0  # how often an idle worker wakes (a stop signal is handled then)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank starts from."""

    config: EngineConfig  # this rank's (its own GPU on CUDA)
    model_dir: str
    rank: int  # global: tensor-parallel rank rank % T of stage rank // T
    tensor_parallel_size: int
    pipeline_parallel_size: int
    store: str  # where the groups meet: a file (all ranks on one machine) or tcp://host:port (rank 0's)
    # Each stage's shared-memory all-reduce file (CPU; None for a stage not wholly on rank 0's machine).
    shm_paths: list[str | None] | None
    # How the steps arrive: the shared-memory ring (msgpack of its RingSpec, and this rank's reader
    # index) on rank 0's machine, else over tcp (msgpack of a TcpFeedSpec).
    ring_spec: bytes | None
    ring_index: int
    tcp_feed: bytes | None
    cores: tuple[int, ...] | None  # CPU cores to pin to (None: not pinned)
    runtime_dir: str  # the group's directory, removed by whoever outlives the other
    leader_pid: int  # rank 0's process: the shared-memory waits give up once it is gone
    bind_host: str | None  # the address gloo binds when the ranks span machines (this rank's node's)


def run_worker(spec: WorkerSpec, parent_conn: Connection) -> None:
    """Process entry point of rank `spec.rank`."""
    init_child_process(f"pagoda-tp{spec.rank}", f"pagoda: tp worker {spec.rank}")
    link = ParentLink(parent_conn, spec.runtime_dir)
    link.watch(lambda command, info: None)  # (no commands: rank 0 speaks through the ring)
    # A parent-death SIGTERM cleans up like a closed pipe; Ctrl-C goes to the whole process group, and
    # rank 0 decides when its workers stop.
    signal.signal(signal.SIGTERM, lambda signum, frame: link.orphaned())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cpu_binding.apply(spec.cores, spec.config.num_threads)
        serve(spec, on_joining=lambda: link.send(Report.READY, phase="joining"))
    except Exception:
        logger.exception("parallel rank %d failed", spec.rank)
        raise SystemExit(1) from None


def serve(spec: WorkerSpec, on_joining: Callable[[], None]) -> None:
    """Join the groups (`on_joining` just before: rank 0 waits for it), load this rank's share of the
    model, then follow rank 0's steps until it says stop (or its ring closes). Whatever starts the rank
    (a child process here, a Ray actor in engine_core/parallel/ray_ranks.py) runs this."""
    import msgspec
    import torch

    from pagoda.engine_core.model_config import ModelConfig
    from pagoda.engine_core.model_runner import ModelRunner
    from pagoda.engine_core.parallel.distributed import init_groups
    from pagoda.engine_core.parallel.shm_ring import RingReader, RingSpec, process_gone
    from pagoda.engine_core.parallel.tcp_feed import TcpFeedReader, TcpFeedSpec

    keep_freed_memory()  # before the model loads, as rank 0 does (engine_core/host_memory.py)
    config = spec.config
    torch.manual_seed(config.seed)
    # Connected before the groups: rank 0 may send its first step as soon as every rank has joined.
    reader: RingReader | TcpFeedReader
    if spec.tcp_feed is not None:
        reader = TcpFeedReader(msgspec.msgpack.decode(spec.tcp_feed, type=TcpFeedSpec))
    else:
        assert spec.ring_spec is not None
        reader = RingReader(msgspec.msgpack.decode(spec.ring_spec, type=RingSpec), spec.ring_index)
    try:
        on_joining()
        group, pipe = init_groups(
            spec.rank,
            spec.tensor_parallel_size,
            spec.pipeline_parallel_size,
            spec.store,
            config.torch_device(),
            shm_paths=spec.shm_paths,
            peers_alive=lambda: not process_gone(spec.leader_pid),  # (rank 0 lives: the group does)
            bind_host=spec.bind_host,
        )
        try:
            runner = ModelRunner(config, Path(spec.model_dir), ModelConfig.from_dir(spec.model_dir), group, pipe)
            freeze_startup_heap()
            _follow(reader, runner)
        finally:
            group.close()
            if pipe is not None:
                pipe.close()
    finally:
        reader.close()


def _follow(reader, runner) -> None:
    """Run each step rank 0 sends, until it says stop or its ring closes."""
    from pagoda.engine_core.parallel import step_message
    from pagoda.engine_core.parallel.shm_ring import RingClosed, RingPeerGone

    while True:
        try:
            buffer = reader.read(timeout_s=_READ_POLL_S)
        except TimeoutError:
            continue
        except (RingClosed, RingPeerGone):
            return  # rank 0 closed the ring or is gone: nothing more will come
        message = step_message.decode(buffer)
        if message == step_message.STOP:
            return
        if message == step_message.HEAD:
            runner.follow_head()
        else:
            assert isinstance(message, step_message.StepMessage)
            runner.follow(message.step, message.rows)
