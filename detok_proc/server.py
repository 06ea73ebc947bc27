"""The tokenizer process: the frontend socket's server, between clients and the engine core.

Clients (api_proc workers, direct `EngineClient`s) talk to a ROUTER socket; each message's identity
frame says which client it came from, and deltas go back to that identity only. There is one ROUTER
for ipc:// clients and, when the server is exposed over tcp://, a second one with CURVE
authentication; a client key is the socket's index byte followed by the ZeroMQ identity. Prompts are tokenized
(chat templates rendered) here, fanned out into one engine request per sample, and the engine's token
deltas come back as text deltas (incremental detokenization, stop strings). One thread, one poll loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from collections import defaultdict
from multiprocessing.connection import Connection

import msgspec
import zmq

from detok_proc.incremental import IncrementalDetokenizer
from detok_proc.limits import FrontendLimits
from detok_proc.metrics import DetokMetrics
from detok_proc.requests import RequestInvalid, SampleState, check_context, check_request_options
from detok_proc.tokenizing import PromptTokenizer
from engine_core import protocol
from engine_core.gguf_model import model_source
from engine_core.json_limits import depth_message
from engine_core.lifecycle import ParentLink, Report, Role, init_child_process
from engine_core.tokenizer import load_tokenizer
from engine_core.validation import ParamError, check_token_ids
from engine_core.zmq_security import CurveConfig

logger = logging.getLogger(__name__)
_POLL_MS = 500


class DetokProc:
    def __init__(
        self,
        model_dir: str,
        frontend_addrs: list[str],
        engine_input_addr: str,
        engine_output_addr: str,
        stall_timeout: float = 30.0,
        tcp_addr: str | None = None,
        curve: CurveConfig | None = None,
        limits: FrontendLimits | None = None,
        model_name: str | None = None,
    ):
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
        self.to_engine = self.ctx.socket(zmq.PUSH)
        self.to_engine.connect(engine_input_addr)
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.connect(engine_output_addr)
        self.poller = zmq.Poller()
        for router in self.frontends:
            self.poller.register(router, zmq.POLLIN)
        self.poller.register(self.from_engine, zmq.POLLIN)
        self.poller.register(self.prompts.fileno(), zmq.POLLIN)

        self.engine: protocol.EngineReady | None = None
        self.engine_dead: str | None = None
        self.last_engine_message = time.monotonic()
        self.stats = protocol.SchedulerStatsMessage(0, 0, 0.0, 0)
        self.samples: dict[str, SampleState] = {}  # engine request id -> its sample
        self.by_client: dict[tuple[bytes, str], list[str]] = {}  # (identity, client id) -> engine ids
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self._pending_resets: dict[str, tuple[bytes, str]] = {}  # engine id -> (client, client's id)
        self.stop_requested = False
        self.on_ready = lambda: None
        self.limits = limits or FrontendLimits()
        self.metrics = DetokMetrics(model_name or model_dir, lambda: self.stats)

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

    def _to_engine(self, message) -> None:
        self.to_engine.send(protocol.encoder.encode(message), copy=False)

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
        elif isinstance(message, protocol.AbortRequest):
            self._abort(identity, message.request_ids, by_client=True)
        elif isinstance(message, protocol.HealthQuery):
            self._reply(identity, self._health(message.request_id))
        elif isinstance(message, protocol.MetricsQuery):
            self._reply(identity, protocol.MetricsReport(message.request_id, self.metrics.render()))
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
            self._pending_resets[engine_id] = (identity, message.request_id)
            self._to_engine(protocol.ResetPrefixCache(engine_id))

    def _handle_frontend_safely(self, client: bytes, frame: bytes) -> None:
        """One client's bad luck (a tokenizer error, a malformed buffer) must not end the process."""
        try:
            self._handle_frontend(client, frame)
        except Exception as exc:  # noqa: BLE001 - answered as a server error, the loop goes on
            self._failed(client, _peek_request_id(frame), exc)

    def _failed(self, client: bytes, request_id: str, exc: Exception) -> None:
        logger.exception("request from a client failed", exc_info=exc)
        self._abort(client, [request_id])
        self._reply(
            client,
            protocol.RequestError(
                request_id=request_id, status=500, error_type="server_error", message=f"{type(exc).__name__}: {exc}"
            ),
        )

    def _require_engine(self) -> protocol.EngineReady:
        if self.engine_dead is not None:
            raise RequestInvalid(f"the engine has failed: {self.engine_dead}", status=503, code="engine_dead")
        if self.engine is None:
            raise RequestInvalid("the server is starting; try again shortly", status=503, code="not_ready")
        return self.engine

    def _start(self, identity: bytes, request: protocol.GenerateRequest) -> None:
        """Check what needs no tokens, then tokenize (inline, or in the background for a long prompt)
        and admit the request (`_admit`)."""
        arrival = time.monotonic()
        engine = self._require_engine()
        key = (identity, request.request_id)
        if key in self.by_client or self.prompts.is_pending(key):
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        check_request_options(request, engine.vocab_size)
        self.prompts.tokenize(
            key,
            request,
            engine.vocab_size,
            self._token_limit(engine),
            lambda ids: self._admit(key, request, ids, arrival),
        )

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
        self.limits.check(len(ids), params.n, len(self.samples), prompt_param)
        self.limits.cap_max_tokens(params, len(ids), engine.max_model_len)
        check_context(len(ids), params.max_tokens, engine.max_model_len, prompt_param)
        prompt_tokens = protocol.pack_tokens(ids)
        engine_ids = self.by_client[key] = []  # registered first, so a failure below can abort them
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
            )
            if request.return_prompt and index == 0:
                sample.prompt = request.prompt if request.prompt is not None else self.tokenizer.decode(ids)
                sample.prompt_tokens = prompt_tokens
            sample.timing.arrival = arrival
            self.samples[engine_id] = sample
            engine_ids.append(engine_id)
            self._to_engine(protocol.AddRequest(engine_id, prompt_tokens, params.for_sample(index), request.cache_salt))

    def _abort(self, identity: bytes, request_ids: list[str], by_client: bool = False) -> None:
        """Stop the engine work of these requests; `by_client`: the client asked (or vanished), so
        they count as finished by ABORT in the metrics; errors end requests uncounted."""
        engine_ids = []
        for request_id in request_ids:
            self.prompts.cancel((identity, request_id))
            for engine_id in self.by_client.pop((identity, request_id), []):
                sample = self.samples.pop(engine_id, None)
                if sample is not None:
                    engine_ids.append(engine_id)
                    if by_client:
                        self.metrics.finished(sample, protocol.FinishReason.ABORT)
        if engine_ids:
            self._to_engine(protocol.AbortRequests(engine_ids))

    def _abort_client(self, identity: bytes) -> None:
        self._abort(
            identity,
            [rid for ident, rid in [*self.by_client, *self.prompts.pending_keys()] if ident == identity],
            by_client=True,
        )

    def _fail_all(self, message: str) -> None:
        for identity, request_id in [*self.by_client, *self.prompts.pending_keys()]:
            self._reply(
                identity,
                protocol.RequestError(
                    request_id=request_id, status=503, message=message, error_type="server_error", code="engine_dead"
                ),
            )
        for identity, request_id in self._pending_resets.values():
            self._reply(
                identity,
                protocol.RequestError(
                    request_id=request_id, status=503, message=message, error_type="server_error", code="engine_dead"
                ),
            )
        self._pending_resets.clear()
        for key in self.prompts.pending_keys():
            self.prompts.cancel(key)
        self.by_client.clear()
        self.samples.clear()

    def _health(self, request_id: str) -> protocol.HealthReport:
        silence = time.monotonic() - self.last_engine_message
        ready = self.engine is not None
        if self.engine_dead is not None:
            healthy, message = False, f"engine failed: {self.engine_dead}"
        elif not ready:
            healthy, message = False, "starting: the engine is loading the model"
        elif silence > self.stall_timeout:
            healthy, message = False, f"engine loop stalled: no progress for {silence:.0f}s"
        else:
            healthy, message = True, "ok"
        s = self.stats
        return protocol.HealthReport(
            request_id=request_id,
            ready=ready,
            healthy=healthy,
            message=message,
            model=model_source(self.model_dir),  # a GGUF's file, not the directory made from it
            max_model_len=self.engine.max_model_len if ready else 0,
            seconds_since_engine_progress=silence,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            quantization=self.engine.quantization if self.engine is not None else None,
            weight_bytes=self.engine.weight_bytes if self.engine is not None else 0,
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

    # ---- outputs from the engine -----------------------------------------------------------------
    def _handle_engine(self, frame: bytes) -> None:
        message = protocol.output_decoder.decode(frame)
        self.last_engine_message = time.monotonic()
        if isinstance(message, protocol.StepOutputs):
            self.stats = message.stats
            self._route(message.deltas)
        elif isinstance(message, protocol.RequestRejected):
            self._rejected(message)
        elif isinstance(message, protocol.EngineReady):
            self.engine = message
            self.metrics.engine_ready(message)
            self.on_ready()
        elif isinstance(message, protocol.PrefixCacheReset):
            client, request_id = self._pending_resets.pop(message.request_id, (None, ""))
            if client is not None:
                self._reply(client, protocol.PrefixCacheResetResult(request_id, message.num_blocks))
        elif isinstance(message, protocol.EngineDead):
            self.engine_dead = message.message
            self._fail_all(f"the engine has failed: {message.message}")

    def _route(self, deltas: list[protocol.RequestDelta]) -> None:
        outgoing: dict[bytes, list[protocol.GenerateDelta]] = defaultdict(list)
        stopped = []
        for delta in deltas:
            sample = self.samples.get(delta.request_id)
            if sample is None:  # aborted by its client, or already ended by a stop string
                continue
            try:
                out = sample.delta(delta, self._token_text)
            except Exception as exc:  # e.g. a tokenizer that cannot decode: end this one only
                logger.exception("detokenizing request %s failed", sample.client_request_id)
                self._abort(sample.identity, [sample.client_request_id])
                self._reply(
                    sample.identity,
                    protocol.RequestError(
                        request_id=sample.client_request_id,
                        status=500,
                        error_type="server_error",
                        message=f"the output could not be detokenized: {type(exc).__name__}: {exc}",
                    ),
                )
                continue
            outgoing[sample.identity].append(out)
            self.metrics.tokens(sample, delta)
            if out.finish_reason is not None:
                self.metrics.finished(sample, out.finish_reason)
                del self.samples[delta.request_id]
                self._sample_done(sample, delta.request_id)
                if not delta.finished:  # ended here by a stop string: the engine must stop too
                    stopped.append(delta.request_id)
        if stopped:
            self._to_engine(protocol.AbortRequests(stopped))
        for identity, outs in outgoing.items():
            self._reply(identity, protocol.GenerateOutputs(outs))

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
            return
        self._abort(sample.identity, [sample.client_request_id])
        self._reply(
            sample.identity, RequestInvalid(message.message, message.param).to_message(sample.client_request_id)
        )

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
                elif socket is self.from_engine:
                    while True:
                        try:
                            frame = self.from_engine.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_engine(frame)
                else:
                    prefix = bytes([self.frontends.index(socket)])
                    while True:
                        try:
                            identity, frame = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_frontend_safely(prefix + identity, frame)

    def close(self) -> None:
        self.prompts.close()
        if self.auth is not None:
            self.auth.stop()
        for socket in (*self.frontends, self.to_engine, self.from_engine):
            socket.close(linger=0)
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
    engine_input_addr: str,
    engine_output_addr: str,
    stall_timeout: float = 30.0,
    tcp_addr: str | None = None,
    curve: CurveConfig | None = None,
    parent_conn: Connection | None = None,
    runtime_dir: str | None = None,
    limits: FrontendLimits | None = None,
    model_name: str | None = None,
) -> None:
    """Process entry point; exits 0 on SIGTERM/SIGINT or the parent's "stop"."""
    init_child_process(Role.DETOK.process_name())
    started = time.monotonic()
    proc = DetokProc(
        model_dir,
        frontend_addrs,
        engine_input_addr,
        engine_output_addr,
        stall_timeout,
        tcp_addr,
        curve,
        limits,
        model_name,
    )
    link = ParentLink(parent_conn, runtime_dir, proc.ipc_files) if parent_conn is not None else None

    def request_stop(*_):
        proc.stop_requested = True

    handler = request_stop if link is None else signal.SIG_IGN  # under a parent, the parent decides
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if link is not None:
        link.watch(lambda command: request_stop())
        proc.on_ready = lambda: link.send(Report.READY, seconds=round(time.monotonic() - started, 2))
    logger.info(
        "tokenizer process %d serving %s", os.getpid(), ", ".join(frontend_addrs + ([tcp_addr] if tcp_addr else []))
    )
    try:
        proc.run()
    finally:
        proc.close()
