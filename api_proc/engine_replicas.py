"""The engine cores of `pagoda serve`: one, or `--data-parallel-size` replicas, started and restarted.

Replica i binds `engine-<i>-in.sock` / `engine-<i>-out.sock` in the runtime directory (the tokenizer
process connects to every pair) and gets its own group of CPU cores (`--cpu-threads-bind`, spelled out
as an explicit group in its config: engine_core/cpu_binding.py). With several replicas, one whose
process exits is restarted (api_proc/replica_restarts.py), and the tokenizer process is told at once
so that its requests fail and none is routed to it until its new process reports ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time

from pagoda.api_proc.replica_restarts import ReplicaRestarts
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.cpu_binding import assign, format_groups
from pagoda.engine_core.lifecycle import Command, Role

logger = logging.getLogger("pagoda.serve")


def replica_configs(config: EngineConfig, num_replicas: int) -> list[EngineConfig]:
    """Each replica's config: the same, but for its own CPU cores (ValueError for a bad binding) and, on
    CUDA, its own GPUs (`data_parallel_rank`). Under tensor parallel a replica's cores are divided again
    over its ranks (engine_core/parallel/sharding.py)."""
    cores = assign(config.cpu_threads_bind, num_replicas)
    configs = [dataclasses.replace(config, data_parallel_rank=i) for i in range(num_replicas)]
    if cores is None:
        return configs
    return [
        dataclasses.replace(c, cpu_threads_bind=format_groups([group])) for c, group in zip(configs, cores, strict=True)
    ]


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


class EngineReplicas:
    def __init__(
        self,
        supervisor,
        target,
        config: EngineConfig,
        num_replicas: int,
        max_restarts: int,
        addrs: list[tuple[str, str]] | None = None,
        target_args: tuple = (),
    ):
        """`target`: the engine process's entry point (pagoda.engine_core.core_proc.run_engine_core, or under
        the Ray backend pagoda.api_proc.ray_replicas.run_ray_replica), called with a replica's config, its
        (input, output) addresses (default: ipc sockets in the runtime directory) and `target_args`."""
        self.supervisor = supervisor
        self.target = target
        self.target_args = target_args
        self.configs = replica_configs(config, num_replicas)
        self.restarts = ReplicaRestarts(num_replicas, max_restarts)
        self.stalled: set[int] = set()  # killed by us because their loop stalled
        runtime_dir = supervisor.runtime_dir
        self.addrs = addrs or [
            (f"ipc://{runtime_dir}/engine-{i}-in.sock", f"ipc://{runtime_dir}/engine-{i}-out.sock")
            for i in range(num_replicas)
        ]
        if num_replicas > 1 and self.configs[0].cpu_threads_bind != config.cpu_threads_bind:
            logger.info("CPU cores per engine replica: %s", " | ".join(c.cpu_threads_bind for c in self.configs))

    @property
    def several(self) -> bool:
        return len(self.addrs) > 1

    def start(self, index: int) -> None:
        for addr in self.addrs[index]:  # a killed process leaves its socket files behind
            if addr.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(addr[len("ipc://") :])
        name_index = index if self.several else None
        self.supervisor.start(
            Role.ENGINE,
            self.target,
            self.configs[index],
            *self.addrs[index],
            *self.target_args,
            index=name_index,
            replica=name_index,
        )

    def start_all(self) -> None:
        for index in range(len(self.addrs)):
            self.start(index)

    def exited(self, child) -> bool:
        """A replica's process has exited while serving: True if the server goes on (it will be restarted,
        or others serve), False if it must stop (the only engine, or every replica down for good)."""
        if not self.several:
            return False
        index = child.index
        self.supervisor.forget(child)
        why = "killed after its loop stalled" if index in self.stalled else describe_exit(child.process.exitcode)
        self.stalled.discard(index)
        delay = self.restarts.exited(index, time.monotonic())
        if delay is None:
            message = f"{why}; down for good after {self.restarts.max_restarts} restart(s) (--max-replica-restarts)"
            logger.error("engine replica %d %s", index, message)
        else:
            attempt = self.restarts.restarts[index]
            message = f"{why}; restart {attempt} of {self.restarts.max_restarts} in {delay:.0f}s"
            logger.error("engine replica %d %s", index, message)
        detok = self.supervisor.find(Role.DETOK)
        if detok is not None:
            detok.link.send(Command.REPLICA_DOWN, index=index, restarting=delay is not None, message=message)
        return not self.restarts.all_down_for_good()

    def restart_due(self) -> None:
        for index in self.restarts.take_due(time.monotonic()):
            logger.info("restarting engine replica %d", index)
            self.start(index)

    def kill_stalled(self, index: int) -> None:
        """The tokenizer process saw replica `index`'s loop stall: kill it (its exit restarts it)."""
        child = self.supervisor.find(Role.ENGINE, index)
        if child is not None and child.process.is_alive():
            logger.error("engine replica %d stalled; killing it", index)
            self.stalled.add(index)
            child.process.kill()
