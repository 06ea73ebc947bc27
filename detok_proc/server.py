"""The tokenizer process: the frontend socket's server, between clients and the engine core.

Clients (api_proc workers, direct `EngineClient`s) talk to a ROUTER socket; each message's identity
frame says which client it came from, and deltas go back to that identity only. There is one ROUTER
for ipc:// clients and, when the server is exposed over tcp://, a second one with CURVE
authentication; a client key is the socket's index byte followed by the ZeroMQ identity. Prompts are tokenized
(chat templates rendered) here, fanned out into one engine request per sample, and the engine's token
deltas come back as text deltas (incremental detokenization, stop strings). One thread, one poll loop.

Under data parallelism (`--data-parallel-size N`) there are N engine cores, each with its own pair of
sockets (detok_proc/replicas.py); each client request is routed to one of them (detok_proc/routing.py,
all of its samples together), and everything about it (deltas, aborts, stop strings) follows that
replica. One engine is the case N = 1 of the same code. A replica that goes down fails its own
requests at once (500, code `engine_dead`); the others go on serving.

This module is the process (`run_detok`) and its loop; the loop hands each event to the part that does
that job: sockets.py (the client sockets), client_messages.py (a client's message), intake.py
(tokenizing and admitting requests), generation.py and pooling.py (requests in flight, deltas to
text), ending.py (aborts and errors), engine_events.py (what the engines say; replicas going down),
replica_set.py (routing, /health), prefix_reset.py (/reset_prefix_cache).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import time
from multiprocessing.connection import Connection

import zmq

from pagoda.detok_proc.client_messages import ClientMessages
from pagoda.detok_proc.ending import RequestEnding
from pagoda.detok_proc.engine_events import EngineEvents
from pagoda.detok_proc.generation import GenerationFrontend
from pagoda.detok_proc.intake import Intake
from pagoda.detok_proc.limits import FrontendLimits
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.metrics_cache import DEFAULT_INTERVAL, MetricsCache
from pagoda.detok_proc.pooling import PoolingFrontend
from pagoda.detok_proc.prefix_reset import PrefixCacheResets
from pagoda.detok_proc.replica_set import ReplicaSet
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.routing import Router
from pagoda.detok_proc.sockets import FrontendSockets
from pagoda.detok_proc.tokenizing import PromptTokenizer
from pagoda.detok_proc.tracing import RequestTracing
from pagoda.engine_core.lifecycle import Command, ParentLink, Report, Role, init_child_process
from pagoda.engine_core.tokenizer import load_tokenizer
from pagoda.engine_core.zmq_security import CurveConfig, EngineLinkKeys

logger = logging.getLogger(__name__)
_POLL_MS = 500


class DetokProc:
    def __init__(
        self,
        model_dir: str,
        frontend_addrs: list[str],
        engine_addrs: list[tuple[str, str]],
        stall_timeout: float = 30.0,
        tcp_addr: str | None = None,
        curve: CurveConfig | None = None,
        limits: FrontendLimits | None = None,
        model_name: str | None = None,
        routing: str = "p2c",
        seed: int = 0,
        link_keys: EngineLinkKeys | None = None,
        otlp_traces_endpoint: str | None = None,
        metrics_interval: float = DEFAULT_INTERVAL,
    ):
        """`engine_addrs`: each engine replica's (input, output) addresses, which the engines bind;
        `metrics_interval`: the longest a rendered /metrics text is served (metrics_cache.py)."""
        self.tokenizer = load_tokenizer(model_dir)
        self.prompts = PromptTokenizer(self.tokenizer)  # inline, or on its background thread
        self.ctx = zmq.Context()
        self.sockets = FrontendSockets(self.ctx, frontend_addrs, tcp_addr, curve, link_keys)
        self.replicas = [EngineReplica(self.ctx, i, *addrs, link_keys) for i, addrs in enumerate(engine_addrs)]
        self.engines = ReplicaSet(self.replicas, Router(routing, seed), stall_timeout, model_dir)
        self.poller = zmq.Poller()
        for router in self.sockets.frontends:
            self.poller.register(router, zmq.POLLIN)
        for replica in self.replicas:
            self.poller.register(replica.from_engine, zmq.POLLIN)
        self.poller.register(self.prompts.fileno(), zmq.POLLIN)
        # Commands of the parent arrive on the parent-link thread: queued, and the loop woken by a byte.
        self.commands: queue.SimpleQueue[tuple[Command, dict]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self.poller.register(self._wake_read, zmq.POLLIN)
        self.stop_requested = False

        self.limits = limits or FrontendLimits()
        self.metrics = DetokMetrics(
            model_name or model_dir,
            lambda: [(r.serving, r.stats) for r in self.replicas],
            len(self.replicas),
            lambda: self.prompts.handed_bytes,
        )
        self.metrics_cache: MetricsCache[tuple[bytes, str]] = MetricsCache(self.metrics.render, metrics_interval)
        self.poller.register(self.metrics_cache.fileno(), zmq.POLLIN)
        self.tracing = RequestTracing(otlp_traces_endpoint, model_name or model_dir) if otlp_traces_endpoint else None

        # The loop's jobs, each given what it works with. Engine request ids are unique across all of them.
        ids = itertools.count()
        new_engine_id = lambda: str(next(ids))  # noqa: E731
        # Embedding requests (an embedding model: detok_proc/pooling.py)
        self.pooling = PoolingFrontend(
            self.tokenizer, self.prompts, self.limits, self.metrics, self._reply, new_engine_id
        )
        self.generations = GenerationFrontend(
            self.tokenizer,
            self.metrics,
            self.tracing,
            self._reply,
            new_engine_id,
            lambda client, request_id, message: self.ending.end_with_server_error(client, request_id, message),
            self.pooling.deliver,
        )
        self.ending = RequestEnding(self.prompts, self.replicas, self.generations, self.pooling, self._reply)
        self.resets = PrefixCacheResets(self._reply, new_engine_id)
        self.intake = Intake(
            self.tokenizer,
            self.prompts,
            self.limits,
            self.engines,
            self.generations,
            self.pooling,
            self.ending,
            self._reply,
        )
        self.engine_events = EngineEvents(
            self.engines, self.generations, self.ending, self.resets, self.metrics, self.poller
        )
        self.client_messages = ClientMessages(
            self.intake,
            self.ending,
            self.engines,
            self.generations,
            self.resets,
            self.metrics,
            self.metrics_cache,
            self._reply,
        )

    def _reply(self, client: bytes, message) -> None:
        try:
            self.sockets.send(client, message)
        except zmq.ZMQError:  # the client is gone (EHOSTUNREACH): stop working for it
            self.ending.abort_client(client)

    def post_command(self, command: Command, info: dict) -> None:
        """From the parent-link thread: have the loop handle `command` (`_handle_commands`)."""
        self.commands.put((command, info))
        os.write(self._wake_write, b"c")

    def _handle_commands(self) -> None:
        """The parent's news about engine replicas (Command.REPLICA_DOWN), in the loop's thread."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 4096)
        while True:
            try:
                command, info = self.commands.get_nowait()
            except queue.Empty:
                return
            if command is Command.REPLICA_DOWN:
                replica = self.replicas[info["index"]]
                self.engine_events.replica_down(replica, info["message"])
                replica.restarting = bool(info["restarting"])

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stop_requested:
            for socket, _ in self.poller.poll(_POLL_MS):
                if socket == self.prompts.fileno():
                    self.intake.background_done()
                elif socket == self.metrics_cache.fileno():
                    self.client_messages.metrics_rendered()
                elif socket == self._wake_read:
                    self._handle_commands()
                elif socket in self.sockets.frontends:
                    prefix = self.sockets.client_prefix(socket)
                    while True:
                        try:
                            identity, frame = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.client_messages.handle_safely(prefix + identity, frame)
                else:  # an engine's output (unless that replica went down since the poll)
                    replica = next((r for r in self.replicas if r.from_engine is socket), None)
                    while replica is not None and replica.from_engine is socket:  # (replaced when it goes down)
                        try:
                            frame = socket.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.engine_events.handle(replica, frame)
            self.engine_events.check_stalls()
            self.metrics.tick()  # the dashboard's rates: totals once a second (the poll wakes twice a second)

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
        self.prompts.close()
        self.metrics_cache.close()
        self.sockets.close()
        for replica in self.replicas:
            replica.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.ctx.term()
        self.sockets.remove_ipc_files()


def run_detok(
    model_dir: str,
    frontend_addrs: list[str],
    engine_addrs: list[tuple[str, str]],
    stall_timeout: float = 30.0,
    tcp_addr: str | None = None,
    curve: CurveConfig | None = None,
    parent_conn: Connection | None = None,
    runtime_dir: str | None = None,
    limits: FrontendLimits | None = None,
    model_name: str | None = None,
    routing: str = "p2c",
    seed: int = 0,
    link_keys: EngineLinkKeys | None = None,
    otlp_traces_endpoint: str | None = None,
    metrics_interval: float = DEFAULT_INTERVAL,
) -> None:
    """Process entry point; exits 0 on SIGTERM/SIGINT or the parent's "stop". `engine_addrs`: each
    engine replica's (input, output) addresses; with `link_keys` this process binds them (tcp, CURVE)
    and the engines connect (the Ray backend)."""
    init_child_process(Role.DETOK.process_name(), Role.DETOK.process_title())
    started = time.monotonic()
    proc = DetokProc(
        model_dir,
        frontend_addrs,
        engine_addrs,
        stall_timeout,
        tcp_addr,
        curve,
        limits,
        model_name,
        routing,
        seed,
        link_keys,
        otlp_traces_endpoint,
        metrics_interval,
    )
    link = ParentLink(parent_conn, runtime_dir, proc.sockets.ipc_files) if parent_conn is not None else None

    def request_stop(*_):
        proc.stop_requested = True

    def on_command(command: Command, info: dict) -> None:
        if command is Command.STOP:
            request_stop()
        else:
            proc.post_command(command, info)

    handler = request_stop if link is None else signal.SIG_IGN  # under a parent, the parent decides
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if link is not None:
        link.watch(on_command)
        proc.engine_events.on_ready = lambda: link.send(Report.READY, seconds=round(time.monotonic() - started, 2))
        proc.engine_events.on_stalled = lambda index: link.send(Report.REPLICA_STALLED, index=index)
    logger.info(
        "tokenizer process %d serving %s", os.getpid(), ", ".join(frontend_addrs + ([tcp_addr] if tcp_addr else []))
    )
    try:
        proc.run()
    finally:
        proc.close()
