"""One engine core as the tokenizer process sees it: its two sockets and what it last reported.

With `--data-parallel-size N` there are N of these, each with a PUSH socket to the engine's input and
a PULL socket from its output (the engine binds both, at addresses the launcher gives both sides; under
the Ray backend this side binds them on tcp, as a CURVE server, and the engine connects).
A replica is serving once its EngineReady came and until it is down: it reported EngineDead, the
launcher saw its process exit, or (with N > 1) its loop stalled. Going down drops its sockets and
connects fresh ones to the same addresses, where the launcher's restarted process will bind: nothing
queued for the old process (requests already failed) can reach the new one.
"""

from __future__ import annotations

import logging
import time

import zmq

from pagoda.detok_proc.routing import ReplicaLoad
from pagoda.engine_core import protocol
from pagoda.engine_core.zmq_security import EngineLinkKeys

logger = logging.getLogger(__name__)


def _bind(socket: zmq.Socket, addr: str) -> None:
    """Bind, retrying for a moment while the previous socket on the address is still closing."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            socket.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def idle_stats() -> protocol.SchedulerStatsMessage:
    return protocol.SchedulerStatsMessage(0, 0, 0.0, 0)


class EngineReplica:
    def __init__(
        self, ctx: zmq.Context, index: int, input_addr: str, output_addr: str, link_keys: EngineLinkKeys | None = None
    ):
        """`link_keys`: the engine connects back over tcp (the Ray backend): this side binds the
        addresses, as a CURVE server admitting only the engines' key."""
        self.ctx = ctx
        self.index = index
        self.input_addr = input_addr
        self.output_addr = output_addr
        self.link_keys = link_keys
        self.ready: protocol.EngineReady | None = None  # while serving
        self.failure: str | None = None  # why it is down, until it is ready again
        self.restarting = False  # down, and the launcher restarts it (else it stays down)
        self.ever_ready = False
        self.last_message = time.monotonic()
        self.stats = idle_stats()
        self.sent_since_stats = 0  # requests sent after the engine built `stats`
        self._connect()

    def _connect(self) -> None:
        self.to_engine = self.ctx.socket(zmq.PUSH)
        self.from_engine = self.ctx.socket(zmq.PULL)
        if self.link_keys is None:
            self.to_engine.connect(self.input_addr)
            self.from_engine.connect(self.output_addr)
            return
        for socket, addr in ((self.to_engine, self.input_addr), (self.from_engine, self.output_addr)):
            socket.linger = 0
            self.link_keys.make_server(socket)
            _bind(socket, addr)

    @property
    def serving(self) -> bool:
        return self.ready is not None and self.failure is None

    def send(self, message) -> None:
        if self.link_keys is None:  # (a connected PUSH queues until the engine binds)
            self.to_engine.send(protocol.encoder.encode(message), copy=False)
            return
        # A bound PUSH with no engine connected would block the loop: the engine is gone, and the
        # requests sent to it fail when the replica is reported down.
        try:
            self.to_engine.send(protocol.encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("engine replica %d is not connected; a message to it was dropped", self.index)

    def load(self) -> ReplicaLoad | None:
        """What the router weighs (None: not serving)."""
        if not self.serving:
            return None
        s = self.stats
        return ReplicaLoad(s.num_running + s.num_waiting + self.sent_since_stats, s.kv_cache_usage)

    def heard(self) -> None:
        self.last_message = time.monotonic()

    def got_stats(self, stats: protocol.SchedulerStatsMessage) -> None:
        self.stats = stats
        self.sent_since_stats = 0

    def became_ready(self, ready: protocol.EngineReady) -> None:
        self.ready, self.failure, self.restarting, self.ever_ready = ready, None, False, True
        self.stats, self.sent_since_stats = idle_stats(), 0

    def went_down(self, reason: str, poller: zmq.Poller) -> None:
        """Stop serving; fresh sockets for whatever process binds the addresses next."""
        self.ready, self.failure = None, reason
        self.stats, self.sent_since_stats = idle_stats(), 0
        poller.unregister(self.from_engine)
        self.close()
        self._connect()
        poller.register(self.from_engine, zmq.POLLIN)

    def status(self, stall_timeout: float) -> tuple[str, str]:
        """(state, what it is doing) in the words /health uses; the state is "ok" (serving and
        progressing), "starting", "stalled", "restarting" or "down" (for good)."""
        if self.failure is not None:
            return ("restarting" if self.restarting else "down"), f"engine failed: {self.failure}"
        if self.ready is None:
            return "starting", "starting: the engine is loading the model"
        silence = time.monotonic() - self.last_message
        if silence > stall_timeout:
            return "stalled", f"engine loop stalled: no progress for {silence:.0f}s"
        return "ok", "ok"

    def health(self, stall_timeout: float) -> protocol.EngineHealth:
        state, message = self.status(stall_timeout)
        s = self.stats
        return protocol.EngineHealth(
            index=self.index,
            state=state,
            message=message,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
        )

    def close(self) -> None:
        self.to_engine.close(linger=0)
        self.from_engine.close(linger=0)
