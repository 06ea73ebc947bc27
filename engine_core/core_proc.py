"""The engine core as its own process: a busy loop around `EngineCore`, fed over ZeroMQ.

While there is work, each iteration drains the input socket without blocking, runs one engine step
and pushes one `StepOutputs` message. When idle it blocks in `poll`, waking once a second to notice a
stop signal and to push an empty `StepOutputs` as a heartbeat, so an idle engine uses no CPU and a
stuck one is noticed (no message for longer than the stall timeout). No asyncio here.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq

from pagoda.engine_core import protocol
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.environment import prefer_passive_thread_waits
from pagoda.engine_core.lifecycle import ParentLink, Report, Role, freeze_startup_heap, init_child_process
from pagoda.engine_core.pooling.config import will_pool
from pagoda.engine_core.validation import param_of
from pagoda.engine_core.zmq_security import EngineLinkKeys

if TYPE_CHECKING:
    from pagoda.engine_core.engine import EngineCore  # (imports torch: only in load(), in the child)
    from pagoda.engine_core.parallel.ranks import WorkerRanks
    from pagoda.engine_core.pooling.engine import PoolingEngineCore

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 1000
# What clients are told; the exception's text and traceback go to the log only.
ENGINE_FAILED = "the engine stopped on an internal error (the server log has the details)"
ADD_FAILED = "the engine could not take this request (an internal error; the server log has the details)"
KV_PAGES_WAIT = 30.0  # most seconds the grammar backend's load waits for the KV pool's pages (huge pools take longer)


def dead_message(exc: BaseException) -> protocol.EngineDead:
    """What clients are told of the failure that stopped the engine: the exception's own words only when
    it was written for them (`client_safe`, e.g. which worker rank died), never internal text."""
    return protocol.EngineDead(str(exc) if getattr(exc, "client_safe", False) else ENGINE_FAILED)


class EngineCoreProc:
    def __init__(self, input_addr: str, output_addr: str, link_keys: EngineLinkKeys | None = None):
        """Binds its input and output sockets; with `link_keys` (an engine placed by Ray, possibly on
        another machine) it connects to the tokenizer process's tcp sockets instead, over CURVE."""
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PULL)
        self.outputs = self.ctx.socket(zmq.PUSH)
        if link_keys is None:
            self.inputs.bind(input_addr)
            self.outputs.bind(output_addr)
        else:
            for socket, addr in ((self.inputs, input_addr), (self.outputs, output_addr)):
                link_keys.make_client(socket)
                socket.connect(addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)
        self.engine: EngineCore | PoolingEngineCore  # set by load(), before anything reads it
        self.stop_requested = False
        self._pending: list[protocol.RequestDelta] = []  # deltas to send with the next step (aborts)

    def _send(self, message) -> None:
        """Send, waiting while no reader is connected (PUSH blocks then), but never past a stop."""
        frame = protocol.encoder.encode(message)
        while True:
            try:
                self.outputs.send(frame, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if self.stop_requested:
                    return
                self.outputs.poll(100, zmq.POLLOUT)

    def _handle(self, message) -> None:
        if isinstance(message, protocol.AddRequest):
            try:
                self.engine.add_request(
                    message.request_id,
                    protocol.unpack_tokens(message.prompt_tokens),
                    message.params,
                    message.cache_salt,
                    pooling=message.pooling,
                )
            except ValueError as exc:  # our own checks: their messages are written for the client
                self._send(protocol.RequestRejected(message.request_id, str(exc), param_of(exc)))
            except Exception:  # nothing was queued, so this request alone is to blame: the engine goes on
                logger.exception("adding request %s failed", message.request_id)
                self._send(protocol.RequestFailed(message.request_id, ADD_FAILED))
        elif isinstance(message, protocol.AbortRequests):
            for request_id in message.request_ids:  # idempotent: unknown or finished ids are ignored
                if self.engine.abort_request(request_id):
                    self._pending.append(protocol.RequestDelta(request_id, [], protocol.FinishReason.ABORT))
        elif isinstance(message, protocol.ResetPrefixCache):
            self._send(protocol.PrefixCacheReset(message.request_id, self.engine.reset_prefix_cache()))
        elif isinstance(message, protocol.Shutdown):
            self.stop_requested = True

    def _drain_inputs(self, timeout_ms: int) -> None:
        """Handle every queued input, waiting up to `timeout_ms` for the first."""
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(protocol.input_decoder.decode(frame.buffer))

    def _step(self) -> None:
        """One engine step (if there is work), then its outputs and stats; also the idle heartbeat."""
        deltas = self._pending
        self._pending = []
        if self.engine.has_unfinished_requests():
            deltas += self.engine.step()
            for ended in self.engine.take_ended():  # bad structured-output specs, requests that failed
                self._send(ended)
        self._send(protocol.StepOutputs(deltas, self.engine.stats(), time.time()))

    def load(self, config: EngineConfig, ranks: WorkerRanks | None = None) -> None:
        """Build and warm up the engine (`ranks`: what starts its parallel ranks, if not child processes)."""
        from pagoda.engine_core.engine import EngineCore, create_engine  # torch is imported here, in the child only

        self.engine = create_engine(config, ranks)
        self.engine.warm_up()
        # The grammar backend (xgrammar, tokenizer: ~3 s of CPU) loads in its thread from here on, after
        # the warm-up rather than beside it (on 2 cores they would only slow each other's start), and at
        # the lowest priority, so that it does not slow the first requests either. It waits for the KV
        # pool's pages first, which the warm-up waits for only a while (engine.KV_PAGES_BEFORE_READY):
        # every request needs those, and at niceness 19 it still took a core from their idle-priority
        # threads (a 2 GiB pool was mapped ~3 s after ready, then 1.3-2.5 s after; now before it).
        if isinstance(self.engine, EngineCore):
            runner = self.engine.runner
            self.engine.structured.start(after=lambda: runner.wait_for_kv_pages(timeout=KV_PAGES_WAIT))
        freeze_startup_heap()

    def run(self) -> None:
        from pagoda.engine_core.gpu_memory import device_memory  # (imports torch: the child only)
        from pagoda.engine_core.pooling.engine import PoolingEngineCore

        engine = self.engine
        self._send(
            protocol.EngineReady(
                engine.runner.num_blocks,
                engine.config.block_size,
                engine.max_model_len,
                engine.model_cfg.vocab_size,
                str(engine.model_dir),
                os.getpid(),
                None if engine.runner.quantization is None else engine.runner.quantization.describe(),
                engine.runner.weight_bytes,
                *device_memory(engine.runner.device),
                engine.pooler.info() if isinstance(engine, PoolingEngineCore) else None,
            )
        )
        was_busy = False
        while not self.stop_requested:
            busy = engine.has_unfinished_requests() or bool(self._pending)
            if was_busy and not busy:
                engine.check_integrity()  # every block back in the pool; a violation kills loudly
            if not busy:
                engine.check_health()  # a dead tensor-parallel worker is fatal even while idle
            was_busy = busy
            self._drain_inputs(0 if busy else _IDLE_POLL_MS)
            self._step()

    def close(self) -> None:
        engine = getattr(self, "engine", None)  # (None if loading failed)
        if engine is not None:
            engine.close()  # stops tensor-parallel workers
        self.inputs.close(linger=0)
        self.outputs.close(linger=1000)  # let the last messages (EngineDead) leave
        self.ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_conn: Connection | None = None,
    runtime_dir: str | None = None,
    replica: int | None = None,
) -> None:
    """Process entry point. Exits 0 on Shutdown, SIGTERM/SIGINT or the parent's "stop"; 1 after
    reporting EngineDead. With `parent_conn` (under `pagoda serve`) it reports "ready" to the parent
    after loading and warming up, and exits as soon as the parent is gone. `replica`: its index under
    data parallelism (named pagoda-engine<index>; its CPU cores are in `config.cpu_threads_bind`)."""
    init_child_process(Role.ENGINE.process_name(replica), Role.ENGINE.process_title(replica))
    if will_pool(config):  # before torch (and its OpenMP) loads
        prefer_passive_thread_waits()
    proc = EngineCoreProc(input_addr, output_addr)
    link = ParentLink(parent_conn, runtime_dir) if parent_conn is not None else None
    if link is not None:
        link.watch(lambda command, info: setattr(proc, "stop_requested", True))

    def request_stop(signum, frame):  # only a flag: the loop notices within one idle poll
        proc.stop_requested = True

    # Alone, signals stop the loop. Under `pagoda serve` the parent decides (it drains the HTTP side
    # first), so a Ctrl-C or a SIGTERM sent to the whole process group must not stop us early.
    handler = request_stop if link is None else signal.SIG_IGN
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        started = time.monotonic()
        proc.load(config)
        if link is not None:
            link.send(
                Report.READY,
                seconds=round(time.monotonic() - started, 2),
                num_blocks=proc.engine.runner.num_blocks,
                max_model_len=proc.engine.max_model_len,
            )
        proc.run()
    except Exception as exc:  # report any failure to the clients (not its text: that is logged), then exit non-zero
        logger.exception("engine core failed")
        proc._send(dead_message(exc))
        proc.close()
        raise SystemExit(1) from exc
    proc.close()
