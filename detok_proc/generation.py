"""Generation requests in the tokenizer process: a client's request, tokenized and admitted, becomes one
engine request per sample (`n`, all to one replica), and the engine's token deltas come back as text deltas
(incremental detokenization, stop strings) sent to the client in one GenerateOutputs per engine step.

The tokenizer process (detok_proc/server.py: intake.py, engine_events.py, ending.py) hands this class
what concerns generation: admitted requests, engine deltas, aborts and replicas going down; the
counterpart of PoolingFrontend (pooling.py) for embeddings.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from pagoda.detok_proc.incremental import IncrementalDetokenizer
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.sample import SampleState
from pagoda.detok_proc.tracing import RequestTracing
from pagoda.engine_core import protocol

logger = logging.getLogger(__name__)

Key = tuple[bytes, str]  # (client identity, the client's request id)


class GenerationFrontend:
    def __init__(
        self,
        tokenizer,
        metrics: DetokMetrics,
        tracing: RequestTracing | None,
        reply: Callable[[bytes, object], None],
        new_engine_id: Callable[[], str],
        end_with_server_error: Callable[[bytes, str, str], None],
        not_generating: Callable[[protocol.RequestDelta], None],
    ):
        """`end_with_server_error(identity, request_id, message)`: end a client's request with a 500;
        `not_generating(delta)`: a delta of no sample here (an embedding request's, or one ended meanwhile)."""
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.tracing = tracing
        self.reply = reply
        self.new_engine_id = new_engine_id
        self.end_with_server_error = end_with_server_error
        self.not_generating = not_generating
        self.samples: dict[str, SampleState] = {}  # engine request id -> its sample
        self.by_client: dict[Key, list[str]] = {}  # (identity, client id) -> engine ids
        self._token_texts: dict[int, str] = {}

    @property
    def num_engine_requests(self) -> int:
        return len(self.samples)

    def owns(self, key: Key) -> bool:
        return key in self.by_client

    # ---- starting -----------------------------------------------------------------------------
    def admit(
        self, key: Key, request: protocol.GenerateRequest, ids: list[int], arrival: float, replica: EngineReplica
    ) -> None:
        """One engine request per sample of a request that passed its checks, every one to `replica`."""
        identity = key[0]
        params = request.params
        prompt_tokens = protocol.pack_tokens(ids)
        replica.sent_since_stats += params.n
        engine_ids = self.by_client[key] = []  # registered first, so a failure below can abort them
        traced = self.tracing is not None and request.trace_context is not None
        trace = self.tracing.admitted(request, arrival, len(ids)) if traced else None
        for index in range(params.n):
            engine_id = self.new_engine_id()
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

    # ---- results ------------------------------------------------------------------------------
    def deliver(self, replica: EngineReplica, deltas: list[protocol.RequestDelta], step_time: float) -> None:
        """`step_time`: when the engine step that made these deltas ended (the engine's wall clock)."""
        outgoing: dict[bytes, list[protocol.GenerateDelta]] = defaultdict(list)
        stopped = []
        for delta in deltas:
            sample = self.samples.get(delta.request_id)
            if sample is None:  # aborted by its client, or already ended by a stop string; or pooling
                self.not_generating(delta)
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
                self.end_with_server_error(
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
            self.reply(identity, protocol.GenerateOutputs(outs))

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

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- ending early -------------------------------------------------------------------------
    def abort(self, key: Key, by_client: bool) -> list[tuple[int, str]]:
        """Forget a client's request: (replica, engine id) of each of its samples still running;
        `by_client`: they count as finished by ABORT in the metrics."""
        running = []
        for engine_id in self.by_client.pop(key, []):
            sample = self.samples.pop(engine_id, None)
            if sample is not None:
                running.append((sample.engine, engine_id))
                if by_client:
                    self.metrics.finished(sample, protocol.FinishReason.ABORT)
                    self._traced(sample, protocol.FinishReason.ABORT)
        return running

    def owner(self, engine_id: str) -> Key | None:
        sample = self.samples.get(engine_id)
        return None if sample is None else (sample.identity, sample.client_request_id)

    def on_replica(self, index: int) -> set[Key]:
        """The client requests with samples running on replica `index`."""
        return {(s.identity, s.client_request_id) for s in self.samples.values() if s.engine == index}
