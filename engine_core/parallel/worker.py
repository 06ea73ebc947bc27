"""A tensor-parallel worker: the process holding rank 1..N-1 of the model, started by the engine core.

It joins the group, loads its shard of the model and KV cache (the same `ModelRunner` as rank 0), then
follows rank 0: each step message from the ring runs the same forward pass and LM head calls, until a
stop message. It exits with its parent (parent-death signal and the parent pipe, engine_core/lifecycle.py),
removing the group's runtime directory if the parent could not, and after any error (exit 1; rank 0's
next collective then fails and the engine reports itself dead).

Nothing here imports torch at module level: a worker pins its CPU threads before torch starts any.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

from engine_core.config import EngineConfig
from engine_core.lifecycle import ParentLink, Report, init_child_process

logger = logging.getLogger(__name__)
_READ_POLL_S = 1.0  # how often an idle worker wakes (a stop signal is handled then)


def pin_to_cores(cores: list[int], num_threads: int | None) -> None:
    """Run this process's torch threads on `cores` (empty: anywhere): `num_threads` of them, default
    one per core."""
    import torch

    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(num_threads or max(1, len(cores)))


def run_tp_worker(
    config: EngineConfig,
    model_dir: str,
    rank: int,
    world_size: int,
    store_path: str,
    shm_path: str | None,
    ring_spec: bytes,
    cores: list[int],
    parent_conn: Connection,
    runtime_dir: str,
) -> None:
    """Process entry point of rank `rank`: the group meets at `store_path` (and all-reduces through
    `shm_path`, if given); `ring_spec` is the msgpack of the ring's RingSpec."""
    init_child_process(f"pagoda-tp{rank}")
    link = ParentLink(parent_conn, runtime_dir)
    link.watch(lambda command, info: None)  # (no commands: rank 0 speaks through the ring)
    # A parent-death SIGTERM cleans up like a closed pipe; Ctrl-C goes to the whole process group, and
    # rank 0 decides when its workers stop.
    signal.signal(signal.SIGTERM, lambda signum, frame: link.orphaned())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pin_to_cores(cores, config.num_threads)
        _serve(config, model_dir, rank, world_size, store_path, shm_path, ring_spec, link)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        raise SystemExit(1) from None


def _serve(
    config: EngineConfig,
    model_dir: str,
    rank: int,
    world_size: int,
    store_path: str,
    shm_path: str | None,
    ring_spec: bytes,
    link,
) -> None:
    import msgspec
    import torch

    from engine_core.model_config import ModelConfig
    from engine_core.model_runner import ModelRunner
    from engine_core.parallel import step_message
    from engine_core.parallel.distributed import init_group
    from engine_core.parallel.shm_ring import RingClosed, RingPeerGone, RingReader, RingSpec

    torch.manual_seed(config.seed)
    link.send(Report.READY, phase="joining")  # rank 0 waits for this (or our death) before it joins
    parent = os.getppid()  # rank 0: while it lives, the group does
    group = init_group(
        rank,
        world_size,
        store_path,
        config.torch_device(),
        shm_path=shm_path,
        peers_alive=lambda: os.getppid() == parent,
    )
    try:
        runner = ModelRunner(config, Path(model_dir), ModelConfig.from_dir(model_dir), group)
        reader = RingReader(msgspec.msgpack.decode(ring_spec, type=RingSpec), rank - 1)
        try:
            while True:
                try:
                    buffer = reader.read(timeout_s=_READ_POLL_S)
                except TimeoutError:
                    continue
                except (RingClosed, RingPeerGone):
                    return  # rank 0 closed the ring or is gone: nothing more will come
                message = step_message.decode(buffer)
                if message is None:
                    return
                runner.follow(message.step, message.rows)
        finally:
            reader.close()
    finally:
        group.close()
