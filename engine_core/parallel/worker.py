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
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from engine_core import cpu_binding
from engine_core.config import EngineConfig
from engine_core.lifecycle import ParentLink, Report, init_child_process

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
    store_path: str  # where the groups meet
    shm_paths: list[str] | None  # each stage's shared-memory all-reduce file (CPU)
    ring_spec: bytes  # msgpack of the broadcast ring's RingSpec
    cores: tuple[int, ...] | None  # CPU cores to pin to (None: not pinned)
    runtime_dir: str  # the group's directory, removed by whoever outlives the other


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
        _serve(spec, link)
    except Exception:
        logger.exception("parallel rank %d failed", spec.rank)
        raise SystemExit(1) from None


def _serve(spec: WorkerSpec, link: ParentLink) -> None:
    import msgspec
    import torch

    from engine_core.model_config import ModelConfig
    from engine_core.model_runner import ModelRunner
    from engine_core.parallel import step_message
    from engine_core.parallel.distributed import init_groups
    from engine_core.parallel.shm_ring import RingClosed, RingPeerGone, RingReader, RingSpec

    config = spec.config
    torch.manual_seed(config.seed)
    link.send(Report.READY, phase="joining")  # rank 0 waits for this (or our death) before it joins
    parent = os.getppid()  # rank 0: while it lives, the group does
    group, pipe = init_groups(
        spec.rank,
        spec.tensor_parallel_size,
        spec.pipeline_parallel_size,
        spec.store_path,
        config.torch_device(),
        shm_paths=spec.shm_paths,
        peers_alive=lambda: os.getppid() == parent,
    )
    try:
        runner = ModelRunner(config, Path(spec.model_dir), ModelConfig.from_dir(spec.model_dir), group, pipe)
        reader = RingReader(msgspec.msgpack.decode(spec.ring_spec, type=RingSpec), spec.rank - 1)
        try:
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
        finally:
            reader.close()
    finally:
        group.close()
        if pipe is not None:
            pipe.close()
