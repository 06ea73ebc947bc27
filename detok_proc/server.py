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
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from pagoda.detok_proc.incremental import IncrementalDetokenizer
from pagoda.detok_proc.limits import FrontendLimits
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.metrics_cache import DEFAULT_INTERVAL, MetricsCache
from pagoda.detok_proc.pooling import PoolingFrontend
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.requests import RequestInvalid, check_context, check_request_options
from pagoda.detok_proc.routing import Router
from pagoda.detok_proc.sample import SampleState
from pagoda.detok_proc.tokenizing import PromptTokenizer
from pagoda.detok_proc.tracing import RequestTracing
from pagoda.engine_core import protocol
from pagoda.engine_core.block_hash import extend_block_hashes
from pagoda.engine_core.gguf_model import model_source
from pagoda.engine_core.json_limits import depth_message
from pagoda.engine_core.lifecycle import Command, ParentLink, Report, Role, freeze_startup_heap, init_child_process
from pagoda.engine_core.tokenizer import load_tokenizer
from pagoda.engine_core.validation import ParamError, check_token_ids
from pagoda.engine_core.zmq_security import CurveConfig, EngineLinkKeys

logger = logging.getLogger(__name__)
_POLL_MS = 500


@dataclass
class PendingReset:
    """A /reset_prefix_cache sent to every serving replica, answered once each has answered."""

    client: bytes
    request_id: str
    waiting: set[int]  # replicas yet to answer
    answered: int = 0
    num_blocks: int = 0
    failures: list[str] = field(default_factory=list)


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
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.prompts = PromptTokenizer(self.tokenizer)  # inline, or on its background thread
        self.stall_timeout = stall_timeout
        self.ctx = zmq.Context()
        self.auth = None
        self.frontends = [self._router(frontend_addrs)]
        self.ipc_files = [addr[len("ipc://") :] for addr in frontend_addrs if addr.startswith("ipc://")]
        if tcp_addr is not None:
            if curve is None:
                raise ValueError("a tcp:// frontend needs CURVE keys")
            self.auth = curve.serve(self.ctx, router := self.ctx.socket(zmq.ROUTER))
            self.frontends.append(self._router([tcp_addr], router))
        if link_keys is not None:  # engines connect back over tcp: admit only their key
            if self.auth is None:
                self.auth = ThreadAuthenticator(self.ctx)
                self.auth.start()
            link_keys.authorize(self.auth)
        self.replicas = [EngineReplica(self.ctx, i, *addrs, link_keys) for i, addrs in enumerate(engine_addrs)]
        self.router = Router(routing, seed)
        self.poller = zmq.Poller()
        for router in self.frontends:
            self.poller.register(router, zmq.POLLIN)
        for replica in self.replicas:
            self.poller.register(replica.from_engine, zmq.POLLIN)
        self.poller.register(self.prompts.fileno(), zmq.POLLIN)
        # Commands of the parent arrive on the parent-link thread: queued, and the loop woken by a byte.
        self.commands: queue.SimpleQueue[tuple[Command, dict]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self.poller.register(self._wake_read, zmq.POLLIN)

        # What every replica serves (vocabulary, context length: the smallest any replica reported).
        self.engine: protocol.EngineReady | None = None
        self.samples: dict[str, SampleState] = {}  # engine request id -> its sample
        self.by_client: dict[tuple[bytes, str], list[str]] = {}  # (identity, client id) -> engine ids
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self._pending_resets: dict[str, PendingReset] = {}  # engine request id -> the client's reset
        self.stop_requested = False
        self.on_ready = lambda: None  # once every replica has been ready
        self._announced_ready = False
        self.on_stalled = lambda index: None  # a replica stalled (N > 1): the parent kills and restarts it
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
        # Embedding requests (an embedding model: detok_proc/pooling.py)
        self.pooling = PoolingFrontend(
            self.tokenizer, self.prompts, self.limits, self.metrics, self._reply, lambda: str(next(self._ids))
        )

    def _router(self, addrs: list[str], router: zmq.Socket | None = None) -> zmq.Socket:
        router = router or self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises, so its work is aborted
        router.setsockopt(zmq.SNDHWM, 0)  # never block the loop on one slow reader
        for addr in addrs:
            router.bind(addr)
        return router

    # ---- sending -----------------------------------------------------------------------------
    def _reply(self, client: bytes, message) -> None:
        try:
            self.frontends[client[0]].send_multipart([client[1:], protocol.encoder.encode(message)], copy=False)
        except zmq.ZMQError:  # the client is gone (EHOSTUNREACH): stop working for it
            self._abort_client(client)

    def post_command(self, command: Command, info: dict) -> None:
        """From the parent-link thread: have the loop handle `command` (`_handle_commands`)."""
        self.commands.put((command, info))
        os.write(self._wake_write, b"c")

    # ---- requests from clients -------------------------------------------------------------------
    def _handle_frontend(self, identity: bytes, frame: bytes) -> None:
        try:
            message = protocol.frontend_request_decoder.decode(frame)
        except RecursionError:  # a hand-made frame nested deeper than any client of ours sends
            self._reply(identity, RequestInvalid(depth_message("request")).to_message(_peek_request_id(frame)))
            return
        except (msgspec.DecodeError, ValueError) as exc:  # includes invalid SamplingParams values
            request_id = _peek_request_id(frame)
            param = exc.param if isinstance(exc, ParamError) else None
            self._reply(identity, RequestInvalid(f"invalid request: {exc}", param).to_message(request_id))
            return
        if isinstance(message, protocol.GenerateRequest):
            try:
                self._start(identity, message)
            except RequestInvalid as exc:
                self._reply(identity, exc.to_message(message.request_id))
        elif isinstance(message, protocol.EmbedRequest):
            try:
                self._start_pooling(identity, message)
            except RequestInvalid as exc:
                self._reply(identity, exc.to_message(message.request_id))
        elif isinstance(message, protocol.AbortRequest):
            self._abort(identity, message.request_ids, by_client=True)
        elif isinstance(message, protocol.HealthQuery):
            self._reply(identity, self._health(message.request_id))
        elif isinstance(message, protocol.MetricsQuery):  # rendered off this loop (metrics_cache.py)
            text = self.metrics_cache.get((identity, message.request_id))
            if text is not None:
                self._reply(identity, protocol.MetricsReport(message.request_id, text))
        elif isinstance(message, protocol.DashboardQuery):
            report = self.metrics.dashboard(self.samples.values())
            self._reply(identity, protocol.DashboardReport(message.request_id, msgspec.json.encode(report)))
        elif isinstance(message, protocol.ApiWorkerStats):  # no answer
            self.metrics.api_worker_stats(message)
        elif isinstance(message, protocol.TokenizeRequest):
            self._tokenize(identity, message)
        elif isinstance(message, protocol.DetokenizeRequest):
            self._detokenize(identity, message)
        elif isinstance(message, protocol.ResetPrefixCacheRequest):
            try:
                self._require_engine()
            except RequestInvalid as exc:
                self._reply(identity, exc.to_message(message.request_id))
                return
            engine_id = f"reset-{next(self._ids)}"
            serving = [r for r in self.replicas if r.serving]
            self._pending_resets[engine_id] = PendingReset(identity, message.request_id, {r.index for r in serving})
            for replica in serving:
                replica.send(protocol.ResetPrefixCache(engine_id))

    def _handle_frontend_safely(self, client: bytes, frame: bytes) -> None:
        """One client's bad luck (a tokenizer error, a malformed buffer) must not end the process."""
        try:
            self._handle_frontend(client, frame)
        except Exception as exc:  # noqa: BLE001 - answered as a server error, the loop goes on
            self._failed(client, _peek_request_id(frame), exc)

    def _failed(self, client: bytes, request_id: str, exc: Exception) -> None:
        """Answer a request this process failed on with a 500 that names no internal detail (logged)."""
        logger.error("request %r from a client failed", request_id, exc_info=exc)
        self._end_with_server_error(
            client, request_id, "the request failed on an internal error (the server log has the details)"
        )

    def _end_with_server_error(self, client: bytes, request_id: str, message: str, code: str | None = None) -> None:
        """End a client's request (every sample of it) with a 500 carrying `message`, written for the client."""
        self._abort(client, [request_id])
        self._reply(
            client,
            protocol.RequestError(
                request_id=request_id, status=500, error_type="server_error", message=message, code=code
            ),
        )

    def _require_engine(self) -> protocol.EngineReady:
        """What the engines serve, while at least one replica serves; else 503."""
        if self.engine is not None and any(r.serving for r in self.replicas):
            return self.engine
        failed = [r for r in self.replicas if r.failure is not None]
        if not failed:
            raise RequestInvalid("the server is starting; try again shortly", status=503, code="not_ready")
        if len(self.replicas) == 1:
            message = f"the engine has failed: {failed[0].failure}"
        else:
            message = "no engine replica is serving: " + "; ".join(
                f"engine {r.index}: {r.status(self.stall_timeout)[1]}" for r in self.replicas
            )
        raise RequestInvalid(message, status=503, code="engine_dead")

    def _start(self, identity: bytes, request: protocol.GenerateRequest) -> None:
        """Check what needs no tokens, then tokenize (inline, or in the background for a long prompt)
        and admit the request (`_admit`)."""
        arrival = time.monotonic()
        engine = self._require_engine()
        if engine.pooling is not None:
            raise RequestInvalid(
                "This model is an embedding model: it does not generate text (use /v1/embeddings or /pooling).",
                "model",
                code="model_not_generative",
            )
        key = (identity, request.request_id)
        if key in self.by_client or self.pooling.owns(key) or self.prompts.is_pending(key):
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        check_request_options(request, engine.vocab_size)
        self.prompts.tokenize(
            key,
            request,
            engine.vocab_size,
            self._token_limit(engine),
            lambda ids: self._admit(key, request, ids, arrival),
        )

    def _start_pooling(self, identity: bytes, request: protocol.EmbedRequest) -> None:
        engine = self._require_engine()
        if (identity, request.request_id) in self.by_client:
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        route = lambda ids: self._route(ids, None, engine.block_size)  # noqa: E731
        self.pooling.start(identity, request, engine, route, self._num_pending())

    def _num_pending(self) -> int:
        """Engine requests running or queued: samples of generation requests, inputs of embedding ones."""
        return len(self.samples) + self.pooling.num_engine_requests

    def _token_limit(self, engine: protocol.EngineReady) -> int:
        return min(engine.max_model_len, self.limits.max_prompt_tokens or engine.max_model_len)

    def _background_done(self) -> None:
        """Continue the requests whose background tokenization has finished (unless aborted since)."""
        for (identity, request_id), then, result, error in self.prompts.finished():
            try:
                if error is not None:
                    raise error
                then(result)
            except RequestInvalid as exc:
                self._abort(identity, [request_id])
                self._reply(identity, exc.to_message(request_id))
            except Exception as exc:  # noqa: BLE001 - answered as a server error, the loop goes on
                self._failed(identity, request_id, exc)

    def _admit(self, key: tuple[bytes, str], request: protocol.GenerateRequest, ids: list[int], arrival: float) -> None:
        """Limits and context checks on the token count, then one engine request per sample."""
        engine = self._require_engine()
        identity = key[0]
        params = request.params
        prompt_param = "messages" if request.messages is not None else "prompt"
        self.limits.check(len(ids), params.n, self._num_pending(), prompt_param)
        self.limits.cap_max_tokens(params, len(ids), engine.max_model_len)
        check_context(len(ids), params.max_tokens, engine.max_model_len, prompt_param)
        prompt_tokens = protocol.pack_tokens(ids)
        replica = self._route(ids, request.cache_salt, engine.block_size)  # every sample goes there
        replica.sent_since_stats += params.n
        engine_ids = self.by_client[key] = []  # registered first, so a failure below can abort them
        traced = self.tracing is not None and request.trace_context is not None
        trace = self.tracing.admitted(request, arrival, len(ids)) if traced else None
        for index in range(params.n):
            engine_id = str(next(self._ids))
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens, request.stop, request.include_stop_str_in_output
            )
            sample = SampleState(
                identity,
                request.request_id,
                index,
                detokenizer,
                len(ids),
                frozenset(params.stop_token_ids),
                params.logprobs,
                engine=replica.index,
            )
            if request.return_prompt and index == 0:
                sample.prompt = request.prompt if request.prompt is not None else self.tokenizer.decode(ids)
                sample.prompt_tokens = prompt_tokens
            sample.timing.arrival = arrival
            sample.trace = None if trace is None else dataclasses.replace(trace)  # one per sample
            self.samples[engine_id] = sample
            engine_ids.append(engine_id)
            replica.send(protocol.AddRequest(engine_id, prompt_tokens, params.for_sample(index), request.cache_salt))

    def _route(self, ids: list[int], cache_salt: str | None, block_size: int) -> EngineReplica:
        """The replica for a request (routing.py); with one engine, that engine."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        prefix: list[bytes] = []  # its first full block's hash, as the engine's prefix cache keys it
        extend_block_hashes(prefix, ids[:block_size], block_size, cache_salt)
        index = self.router.route([r.load() for r in self.replicas], prefix[0] if prefix else None)
        return self.replicas[index]

    def _abort(self, identity: bytes, request_ids: list[str], by_client: bool = False) -> None:
        """Stop the engine work of these requests; `by_client`: the client asked (or vanished), so
        they count as finished by ABORT in the metrics; errors end requests uncounted."""
        by_replica: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            self.prompts.cancel((identity, request_id))
            pooled = self.pooling.abort((identity, request_id))
            if pooled is not None:
                by_replica[pooled[0]].extend(pooled[1])
            for engine_id in self.by_client.pop((identity, request_id), []):
                sample = self.samples.pop(engine_id, None)
                if sample is not None:
                    by_replica[sample.engine].append(engine_id)
                    if by_client:
                        self.metrics.finished(sample, protocol.FinishReason.ABORT)
                        self._traced(sample, protocol.FinishReason.ABORT)
        for index, engine_ids in by_replica.items():
            if self.replicas[index].serving:  # (a replica that is down has forgotten them already)
                self.replicas[index].send(protocol.AbortRequests(engine_ids))

    def _abort_client(self, identity: bytes) -> None:
        self._abort(
            identity,
            [
                rid
                for ident, rid in [*self.by_client, *self.pooling.by_client, *self.prompts.pending_keys()]
                if ident == identity
            ],
            by_client=True,
        )

    def _replica_down(self, replica: EngineReplica, reason: str) -> None:
        """`replica` stopped serving (EngineDead, its process exited, its loop stalled): every request
        it was running fails now with a 500 (the others' go on), and it gets fresh sockets for the
        process the launcher restarts (if any)."""
        if replica.failure is not None:  # already down (EngineDead or a stall, then the launcher saw it exit)
            replica.failure = f"{replica.failure} ({reason})"
            return
        logger.error("engine replica %d is down: %s", replica.index, reason)
        replica.went_down(reason, self.poller)
        self.metrics.engine_down(replica.index)
        failed = {(s.identity, s.client_request_id) for s in self.samples.values() if s.engine == replica.index}
        failed.update(self.pooling.on_replica(replica.index))
        message = f"the engine has failed: {reason}"
        for identity, request_id in failed:
            for engine_id in self.by_client.pop((identity, request_id), []):
                self.samples.pop(engine_id, None)
            self._reply(
                identity,
                protocol.RequestError(
                    request_id=request_id, status=500, message=message, error_type="server_error", code="engine_dead"
                ),
            )
        for engine_id, reset in list(self._pending_resets.items()):
            if replica.index in reset.waiting:
                reset.waiting.discard(replica.index)
                reset.failures.append(message)
                self._reset_answered(engine_id, reset)

    def _reset_answered(self, engine_id: str, reset: PendingReset) -> None:
        """Answer a reset once no replica is left to answer: the blocks every replica that answered
        dropped (a replica that went down meanwhile has no cache left), or 503 if none answered."""
        if reset.waiting:
            return
        del self._pending_resets[engine_id]
        if reset.answered:
            self._reply(reset.client, protocol.PrefixCacheResetResult(reset.request_id, reset.num_blocks))
        else:
            self._reply(
                reset.client,
                protocol.RequestError(
                    request_id=reset.request_id,
                    status=503,
                    message=reset.failures[0] if reset.failures else "no engine replica is serving",
                    error_type="server_error",
                    code="engine_dead",
                ),
            )

    def _health(self, request_id: str) -> protocol.HealthReport:
        """One engine: its state. Several: healthy while any replica serves, degraded while another
        does not (down, restarting, stalled or still starting)."""
        now = time.monotonic()
        engines = [r.health(self.stall_timeout) for r in self.replicas]
        ok = [e for e in engines if e.state == "ok"]
        if len(engines) == 1:
            healthy, degraded, message = bool(ok), False, engines[0].message
        elif not ok:
            healthy, degraded = False, False
            message = "no engine replica is serving: " + "; ".join(f"engine {e.index}: {e.message}" for e in engines)
        elif len(ok) < len(engines):
            healthy, degraded = True, True
            message = f"degraded: {len(ok)} of {len(engines)} engine replicas serving; " + "; ".join(
                f"engine {e.index}: {e.message}" for e in engines if e.state != "ok"
            )
        else:
            healthy, degraded, message = True, False, "ok"
        # The watchdog's measure (api_proc/sd_notify.py): the longest silence of a serving replica.
        serving = [r for r in self.replicas if r.serving] or self.replicas
        silence = max(now - r.last_message for r in serving)
        ready = self.engine is not None
        usages = [e.kv_cache_usage for e, r in zip(engines, self.replicas, strict=True) if r.serving]
        return protocol.HealthReport(
            request_id=request_id,
            ready=ready,
            healthy=healthy,
            message=message,
            model=model_source(self.model_dir),  # a GGUF's file, not the directory made from it
            max_model_len=self.engine.max_model_len if self.engine is not None else 0,
            seconds_since_engine_progress=silence,
            num_running=sum(e.num_running for e in engines),
            num_waiting=sum(e.num_waiting for e in engines),
            kv_cache_usage=sum(usages) / len(usages) if usages else 0.0,
            quantization=self.engine.quantization if self.engine is not None else None,
            weight_bytes=self.engine.weight_bytes if self.engine is not None else 0,
            degraded=degraded,
            engines=engines,
        )

    def _tokenize(self, identity: bytes, request: protocol.TokenizeRequest) -> None:
        try:
            engine = self._require_engine()
        except RequestInvalid as exc:
            self._reply(identity, exc.to_message(request.request_id))
            return

        def result(ids: list[int]) -> protocol.TokenizeResult:  # built where the tokenizing ran
            strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
            return protocol.TokenizeResult(request.request_id, protocol.pack_tokens(ids), strs, engine.max_model_len)

        try:
            self.prompts.tokenize(
                (identity, request.request_id),
                request,
                engine.vocab_size,
                self._token_limit(engine),
                lambda answer: self._reply(identity, answer),
                result,
            )
        except RequestInvalid as exc:
            self._reply(identity, exc.to_message(request.request_id))

    def _detokenize(self, identity: bytes, request: protocol.DetokenizeRequest) -> None:
        ids = protocol.unpack_tokens(request.tokens)
        try:
            check_token_ids(ids, len(self.tokenizer), "tokens")
            self.prompts.run(
                (identity, request.request_id),
                4 * len(ids),  # ~4 bytes of text per token
                lambda: protocol.DetokenizeResult(request.request_id, self.tokenizer.decode(ids)),
                lambda answer: self._reply(identity, answer),
            )
        except ParamError as exc:
            self._reply(identity, RequestInvalid.of(exc).to_message(request.request_id))
        except RequestInvalid as exc:
            self._reply(identity, exc.to_message(request.request_id))

    # ---- outputs from the engines ----------------------------------------------------------------
    def _handle_engine(self, replica: EngineReplica, frame: bytes) -> None:
        message = protocol.output_decoder.decode(frame)
        if isinstance(message, protocol.EngineReady):
            self._engine_ready(replica, message)
            return
        if replica.failure is not None:  # what a process that is down said last (a stalled one waking)
            return
        replica.heard()
        if isinstance(message, protocol.StepOutputs):
            replica.got_stats(message.stats)
            self._deliver(replica, message.deltas, message.timestamp)
        elif isinstance(message, protocol.RequestRejected):
            self._rejected(message)
        elif isinstance(message, protocol.RequestFailed):
            self._engine_failed(message)
        elif isinstance(message, protocol.PrefixCacheReset):
            reset = self._pending_resets.get(message.request_id)
            if reset is not None and replica.index in reset.waiting:
                reset.waiting.discard(replica.index)
                reset.answered += 1
                reset.num_blocks += message.num_blocks
                self._reset_answered(message.request_id, reset)
        elif isinstance(message, protocol.EngineDead):
            self._replica_down(replica, message.message)

    def _engine_ready(self, replica: EngineReplica, message: protocol.EngineReady) -> None:
        if replica.ever_ready:
            logger.info("engine replica %d is serving again (pid %d)", replica.index, message.pid)
        replica.became_ready(message)
        replica.heard()
        if self.engine is None or message.max_model_len < self.engine.max_model_len:
            self.engine = message
        self.metrics.engine_ready(replica.index, message)
        if not self._announced_ready and all(r.ever_ready for r in self.replicas):
            self._announced_ready = True
            freeze_startup_heap()
            self.on_ready()

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
                self._replica_down(replica, info["message"])
                replica.restarting = bool(info["restarting"])

    def _check_stalls(self) -> None:
        """With several replicas, one whose loop has been silent for the stall timeout is down: its
        requests fail, and the parent kills and restarts it. (One engine only turns /health 503, as
        the server has nothing else to serve with.)"""
        if len(self.replicas) == 1:
            return
        for replica in self.replicas:
            if replica.serving and replica.status(self.stall_timeout)[0] == "stalled":
                self._replica_down(replica, replica.status(self.stall_timeout)[1])
                self.on_stalled(replica.index)

    def _deliver(self, replica: EngineReplica, deltas: list[protocol.RequestDelta], step_time: float) -> None:
        """`step_time`: when the engine step that made these deltas ended (the engine's wall clock)."""
        outgoing: dict[bytes, list[protocol.GenerateDelta]] = defaultdict(list)
        stopped = []
        for delta in deltas:
            sample = self.samples.get(delta.request_id)
            if sample is None:  # aborted by its client, or already ended by a stop string; or pooling
                self.pooling.deliver(delta)
                continue
            try:
                if sample.trace is None:
                    out = sample.delta(delta, self._token_text)
                else:  # traced: the time spent detokenizing counts
                    started = time.perf_counter()
                    out = sample.delta(delta, self._token_text)
                    RequestTracing.tokens(sample.trace, delta, step_time, time.perf_counter() - started)
            except Exception:  # e.g. a tokenizer that cannot decode: end this one only
                logger.exception("detokenizing request %s failed", sample.client_request_id)
                self._end_with_server_error(
                    sample.identity,
                    sample.client_request_id,
                    "the output could not be detokenized (the server log has the details)",
                )
                continue
            outgoing[sample.identity].append(out)
            self.metrics.tokens(sample, delta)
            if out.finish_reason is not None:
                self.metrics.finished(sample, out.finish_reason)
                self._traced(sample, out.finish_reason)
                del self.samples[delta.request_id]
                self._sample_done(sample, delta.request_id)
                if not delta.finished:  # ended here by a stop string: the engine must stop too
                    stopped.append(delta.request_id)
        if stopped:
            replica.send(protocol.AbortRequests(stopped))
        for identity, outs in outgoing.items():
            self._reply(identity, protocol.GenerateOutputs(outs))

    def _traced(self, sample: SampleState, finish_reason: protocol.FinishReason) -> None:
        if self.tracing is not None:
            self.tracing.finished(sample, finish_reason)

    def _sample_done(self, sample: SampleState, engine_id: str) -> None:
        key = (sample.identity, sample.client_request_id)
        siblings = self.by_client.get(key)
        if siblings is not None:
            siblings.remove(engine_id)
            if not siblings:
                del self.by_client[key]

    def _rejected(self, message: protocol.RequestRejected) -> None:
        sample = self.samples.get(message.request_id)
        if sample is None:
            pooled = self.pooling.owner(message.request_id)  # an input of an embedding request
            if pooled is not None:
                self._abort(pooled[0], [pooled[1]])
                self._reply(pooled[0], RequestInvalid(message.message, message.param).to_message(pooled[1]))
            return
        self._abort(sample.identity, [sample.client_request_id])
        self._reply(
            sample.identity, RequestInvalid(message.message, message.param).to_message(sample.client_request_id)
        )

    def _engine_failed(self, message: protocol.RequestFailed) -> None:
        """A request the engine ended mid-way because of its own data: it (with its `n` siblings) fails
        with a 500; the engine serves on."""
        sample = self.samples.get(message.request_id)
        if sample is None:  # (its client is gone, or a sibling's failure already ended it)
            return
        self._end_with_server_error(sample.identity, sample.client_request_id, message.message, "request_failed")

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stop_requested:
            for socket, _ in self.poller.poll(_POLL_MS):
                if socket == self.prompts.fileno():
                    self._background_done()
                elif socket == self.metrics_cache.fileno():
                    self._metrics_rendered()
                elif socket == self._wake_read:
                    self._handle_commands()
                elif socket in self.frontends:
                    prefix = bytes([self.frontends.index(socket)])
                    while True:
                        try:
                            identity, frame = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_frontend_safely(prefix + identity, frame)
                else:  # an engine's output (unless that replica went down since the poll)
                    replica = next((r for r in self.replicas if r.from_engine is socket), None)
                    while replica is not None and replica.from_engine is socket:  # (replaced when it goes down)
                        try:
                            frame = socket.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_engine(replica, frame)
            self._check_stalls()
            self.metrics.tick()  # the dashboard's rates: totals once a second (the poll wakes twice a second)

    def _metrics_rendered(self) -> None:
        waiters, text, error = self.metrics_cache.finished()
        for identity, request_id in waiters:
            if text is not None:
                self._reply(identity, protocol.MetricsReport(request_id, text))
            else:
                self._failed(identity, request_id, error or RuntimeError("the metrics were not rendered"))

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
        self.prompts.close()
        self.metrics_cache.close()
        if self.auth is not None:
            self.auth.stop()
        for socket in self.frontends:
            socket.close(linger=0)
        for replica in self.replicas:
            replica.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.ctx.term()
        for path in self.ipc_files:  # ZeroMQ leaves bound ipc socket files behind
            with contextlib.suppress(OSError):
                os.unlink(path)


def _peek_request_id(frame: bytes) -> str:
    """The request_id of an undecodable request, if it has one, so the error reaches its waiter."""
    try:
        value = msgspec.msgpack.decode(frame)
        return str(value.get("request_id", "")) if isinstance(value, dict) else ""
    except msgspec.DecodeError:
        return ""


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
    link = ParentLink(parent_conn, runtime_dir, proc.ipc_files) if parent_conn is not None else None

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
        proc.on_ready = lambda: link.send(Report.READY, seconds=round(time.monotonic() - started, 2))
        proc.on_stalled = lambda index: link.send(Report.REPLICA_STALLED, index=index)
    logger.info(
        "tokenizer process %d serving %s", os.getpid(), ", ".join(frontend_addrs + ([tcp_addr] if tcp_addr else []))
    )
    try:
        proc.run()
    finally:
        proc.close()
