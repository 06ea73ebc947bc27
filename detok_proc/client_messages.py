"""A client's message to the tokenizer process, decoded and handed to whoever answers it: requests that
need the tokenizer (intake.py), aborts (ending.py), /health, /metrics (rendered off the loop:
metrics_cache.py), the dashboard, the HTTP workers' counters and /reset_prefix_cache (prefix_reset.py).

A frame that does not decode is answered with a 400 naming what is wrong, and anything that fails while
a message is handled with a 500 to that client only: the loop goes on for every other.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from pagoda.detok_proc.ending import RequestEnding
from pagoda.detok_proc.generation import GenerationFrontend
from pagoda.detok_proc.intake import Intake
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.metrics_cache import MetricsCache
from pagoda.detok_proc.prefix_reset import PrefixCacheResets
from pagoda.detok_proc.replica_set import ReplicaSet
from pagoda.detok_proc.requests import RequestInvalid
from pagoda.engine_core import protocol
from pagoda.engine_core.json_limits import depth_message
from pagoda.engine_core.validation import ParamError


class ClientMessages:
    def __init__(
        self,
        intake: Intake,
        ending: RequestEnding,
        engines: ReplicaSet,
        generations: GenerationFrontend,
        resets: PrefixCacheResets,
        metrics: DetokMetrics,
        metrics_cache: MetricsCache[tuple[bytes, str]],
        reply: Callable[[bytes, object], None],
    ):
        self.intake = intake
        self.ending = ending
        self.engines = engines
        self.generations = generations
        self.resets = resets
        self.metrics = metrics
        self.metrics_cache = metrics_cache
        self.reply = reply

    def handle_safely(self, client: bytes, frame: bytes) -> None:
        """One client's bad luck (a tokenizer error, a malformed buffer) must not end the process."""
        try:
            self._handle(client, frame)
        except Exception as exc:  # noqa: BLE001 - answered as a server error, the loop goes on
            self.ending.failed(client, _peek_request_id(frame), exc)

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            message = protocol.frontend_request_decoder.decode(frame)
        except RecursionError:  # a hand-made frame nested deeper than any client of ours sends
            self.reply(identity, RequestInvalid(depth_message("request")).to_message(_peek_request_id(frame)))
            return
        except (msgspec.DecodeError, ValueError) as exc:  # includes invalid SamplingParams values
            request_id = _peek_request_id(frame)
            param = exc.param if isinstance(exc, ParamError) else None
            self.reply(identity, RequestInvalid(f"invalid request: {exc}", param).to_message(request_id))
            return
        if isinstance(message, protocol.GenerateRequest):
            try:
                self.intake.start(identity, message)
            except RequestInvalid as exc:
                self.reply(identity, exc.to_message(message.request_id))
        elif isinstance(message, protocol.EmbedRequest):
            try:
                self.intake.start_pooling(identity, message)
            except RequestInvalid as exc:
                self.reply(identity, exc.to_message(message.request_id))
        elif isinstance(message, protocol.AbortRequest):
            self.ending.abort(identity, message.request_ids, by_client=True)
        elif isinstance(message, protocol.HealthQuery):
            self.reply(identity, self.engines.health(message.request_id))
        elif isinstance(message, protocol.MetricsQuery):  # rendered off this loop (metrics_cache.py)
            text = self.metrics_cache.get((identity, message.request_id))
            if text is not None:
                self.reply(identity, protocol.MetricsReport(message.request_id, text))
        elif isinstance(message, protocol.DashboardQuery):
            report = self.metrics.dashboard(self.generations.samples.values())
            self.reply(identity, protocol.DashboardReport(message.request_id, msgspec.json.encode(report)))
        elif isinstance(message, protocol.ApiWorkerStats):  # no answer
            self.metrics.api_worker_stats(message)
        elif isinstance(message, protocol.TokenizeRequest):
            self.intake.tokenize(identity, message)
        elif isinstance(message, protocol.DetokenizeRequest):
            self.intake.detokenize(identity, message)
        elif isinstance(message, protocol.ResetPrefixCacheRequest):
            try:
                self.engines.require_engine()
            except RequestInvalid as exc:
                self.reply(identity, exc.to_message(message.request_id))
                return
            self.resets.start(identity, message.request_id, self.engines.replicas)

    def metrics_rendered(self) -> None:
        """Answer the /metrics queries that waited for the text being rendered."""
        waiters, text, error = self.metrics_cache.finished()
        for identity, request_id in waiters:
            if text is not None:
                self.reply(identity, protocol.MetricsReport(request_id, text))
            else:
                self.ending.failed(identity, request_id, error or RuntimeError("the metrics were not rendered"))


def _peek_request_id(frame: bytes) -> str:
    """The request_id of an undecodable request, if it has one, so the error reaches its waiter."""
    try:
        value = msgspec.msgpack.decode(frame)
        return str(value.get("request_id", "")) if isinstance(value, dict) else ""
    except msgspec.DecodeError:
        return ""
