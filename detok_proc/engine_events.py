"""What the engine replicas say, and what becomes of them: each message from an engine (its readiness, a
step's deltas, a request it refused or failed, a prefix-cache reset done, its death), a replica whose
loop went silent (a stall), and a replica going down for any reason.

A replica that goes down fails its own requests at once (500, code `engine_dead`); the others go on
serving. It gets fresh sockets for the process the launcher restarts (if any).
"""

from __future__ import annotations

import logging

import zmq

from pagoda.detok_proc.ending import RequestEnding
from pagoda.detok_proc.generation import GenerationFrontend
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.prefix_reset import PrefixCacheResets
from pagoda.detok_proc.replica_set import ReplicaSet
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.engine_core import protocol
from pagoda.engine_core.lifecycle import freeze_startup_heap

logger = logging.getLogger(__name__)


class EngineEvents:
    def __init__(
        self,
        engines: ReplicaSet,
        generations: GenerationFrontend,
        ending: RequestEnding,
        resets: PrefixCacheResets,
        metrics: DetokMetrics,
        poller: zmq.Poller,
    ):
        self.engines = engines
        self.replicas = engines.replicas
        self.generations = generations
        self.ending = ending
        self.resets = resets
        self.metrics = metrics
        self.poller = poller
        self.on_ready = lambda: None  # once every replica has been ready
        self._announced_ready = False
        self.on_stalled = lambda index: None  # a replica stalled (N > 1): the parent kills and restarts it

    def handle(self, replica: EngineReplica, frame: bytes) -> None:
        message = protocol.output_decoder.decode(frame)
        if isinstance(message, protocol.EngineReady):
            self._engine_ready(replica, message)
            return
        if replica.failure is not None:  # what a process that is down said last (a stalled one waking)
            return
        replica.heard()
        if isinstance(message, protocol.StepOutputs):
            replica.got_stats(message.stats)
            self.generations.deliver(replica, message.deltas, message.timestamp)
        elif isinstance(message, protocol.RequestRejected):
            self.ending.rejected(message)
        elif isinstance(message, protocol.RequestFailed):
            self.ending.engine_failed(message)
        elif isinstance(message, protocol.PrefixCacheReset):
            self.resets.answered(replica, message)
        elif isinstance(message, protocol.EngineDead):
            self.replica_down(replica, message.message)

    def _engine_ready(self, replica: EngineReplica, message: protocol.EngineReady) -> None:
        if replica.ever_ready:
            logger.info("engine replica %d is serving again (pid %d)", replica.index, message.pid)
        replica.became_ready(message)
        replica.heard()
        self.engines.replica_ready(message)
        self.metrics.engine_ready(replica.index, message)
        if not self._announced_ready and all(r.ever_ready for r in self.replicas):
            self._announced_ready = True
            freeze_startup_heap()
            self.on_ready()

    def check_stalls(self) -> None:
        """With several replicas, one whose loop has been silent for the stall timeout is down: its
        requests fail, and the parent kills and restarts it. (One engine only turns /health 503, as
        the server has nothing else to serve with.)"""
        if len(self.replicas) == 1:
            return
        stall_timeout = self.engines.stall_timeout
        for replica in self.replicas:
            if replica.serving and replica.status(stall_timeout)[0] == "stalled":
                self.replica_down(replica, replica.status(stall_timeout)[1])
                self.on_stalled(replica.index)

    def replica_down(self, replica: EngineReplica, reason: str) -> None:
        """`replica` stopped serving (EngineDead, its process exited, its loop stalled): every request
        it was running fails now with a 500 (the others' go on), and it gets fresh sockets for the
        process the launcher restarts (if any)."""
        if replica.failure is not None:  # already down (EngineDead or a stall, then the launcher saw it exit)
            replica.failure = f"{replica.failure} ({reason})"
            return
        logger.error("engine replica %d is down: %s", replica.index, reason)
        replica.went_down(reason, self.poller)
        self.metrics.engine_down(replica.index)
        message = f"the engine has failed: {reason}"
        self.ending.replica_down(replica.index, message)
        self.resets.replica_down(replica.index, message)
