"""Embedding requests in the tokenizer process: an EmbedRequest's inputs, tokenized, become one engine
request each (all to one replica), and their pooled vectors go back in one EmbedResult once every input
has its own. The packed float32 buffers pass through untouched: nothing here reads a value.

The tokenizer process (detok_proc/server.py: intake.py, generation.py, ending.py) hands this class what
concerns pooling: requests to start, engine deltas that carry vectors, aborts, rejections and replicas going down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pagoda.detok_proc.limits import FrontendLimits
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.requests import RequestInvalid
from pagoda.detok_proc.tokenizing import QUEUE_BYTES, PromptTokenizer
from pagoda.engine_core import protocol
from pagoda.engine_core.pooling import inputs
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.validation import ParamError, check_token_ids

Key = tuple[bytes, str]  # (client identity, the client's request id)
_UNUSED = SamplingParams()  # an AddRequest's sampling params, which a pooling request does not read


@dataclass
class PendingEmbed:
    """One client request: its inputs' engine requests and what has come back."""

    identity: bytes
    request_id: str
    replica: int
    engine_ids: list[str]
    num_prompt_tokens: list[int]
    task: str
    arrival: float
    outputs: dict[int, protocol.PooledVectors] = field(default_factory=dict)  # input index -> its vectors


class PoolingFrontend:
    def __init__(
        self,
        tokenizer,
        prompts: PromptTokenizer,
        limits: FrontendLimits,
        metrics: DetokMetrics,
        reply: Callable[[bytes, object], None],
        new_engine_id: Callable[[], str],
    ):
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.limits = limits
        self.metrics = metrics
        self.reply = reply
        self.new_engine_id = new_engine_id
        self.by_client: dict[Key, PendingEmbed] = {}
        self.by_engine_id: dict[str, tuple[PendingEmbed, int]] = {}  # engine id -> (its request, input index)

    @property
    def num_engine_requests(self) -> int:
        return len(self.by_engine_id)

    def owns(self, key: Key) -> bool:
        return key in self.by_client

    # ---- starting -----------------------------------------------------------------------------
    def start(
        self,
        identity: bytes,
        request: protocol.EmbedRequest,
        engine: protocol.EngineReady,
        route: Callable[[list[int]], EngineReplica],
        num_pending: int,
    ) -> None:
        """Check the request, tokenize its inputs (inline, or in the background when long) and send one
        engine request per input; RequestInvalid (naming the field) for what cannot be served."""
        arrival = time.monotonic()
        key = (identity, request.request_id)
        if engine.pooling is None:
            raise RequestInvalid(
                "This model generates text; it is not an embedding model, so /v1/embeddings and /pooling are not "
                "served here (use /v1/completions or /v1/chat/completions, or serve an embedding model).",
                "model",
                code="model_not_embedding",
            )
        if key in self.by_client or self.prompts.is_pending(key):
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        if (request.texts is None) == (request.token_ids is None):
            raise RequestInvalid("Invalid 'input': give either texts or token ids.", "input")
        params = request.pooling or PoolingParams()
        info = engine.pooling
        try:
            params.validate(info.hidden_size, info.matryoshka, info.matryoshka_dimensions)
            keep = inputs.truncation(request.truncate_prompt_tokens, engine.max_model_len)
        except ParamError as exc:
            raise RequestInvalid.of(exc) from None
        count = len(request.texts if request.texts is not None else request.token_ids or [])
        if count == 0:
            raise RequestInvalid("Invalid 'input': the list of inputs is empty.", "input", code="empty_input")
        limit = self.limits.max_batch_inputs
        if limit is not None and count > limit:
            raise RequestInvalid(
                f"Invalid 'input': this server embeds at most {limit} inputs per request, but got {count}.",
                "input",
                code="too_many_inputs",
            )
        # 429 when full (lengths are checked below). A request of more inputs than the pending limit
        # would never fit: it is admitted when nothing else is pending.
        most = self.limits.max_pending_requests
        self.limits.check(0, count if most is None else min(count, most), num_pending, "input")
        if request.texts is not None:
            texts = request.texts
            size = sum(len(t.encode()) for t in texts)
            if size > QUEUE_BYTES:  # (more than the background queue ever takes: it would answer 429 forever)
                raise RequestInvalid(
                    f"Invalid 'input': the inputs hold {size} bytes of text; this server embeds at most "
                    f"{QUEUE_BYTES} bytes per request.",
                    "input",
                )

            def work() -> list[list[int]]:
                return inputs.tokenize(self.tokenizer, texts, request.add_special_tokens, keep)
        else:
            packed = request.token_ids or []
            size = 4 * sum(len(p) for p in packed)

            def work() -> list[list[int]]:
                token_ids = [inputs.keep_last(protocol.unpack_tokens(p), keep) for p in packed]
                for index, ids in enumerate(token_ids):
                    try:
                        check_token_ids(ids, engine.vocab_size, "input")
                    except ParamError as exc:
                        raise RequestInvalid(f"{exc} (input {index})", "input") from None
                return token_ids

        def admit(token_ids: list[list[int]]) -> None:
            self._admit(key, params, token_ids, engine, route, arrival)

        values_per_token = info.hidden_size if params.task == "token_embed" else None
        self.prompts.run(key, size, lambda: self._checked(work, engine.max_model_len, values_per_token), admit)

    def _checked(
        self, work: Callable[[], list[list[int]]], max_model_len: int, values_per_token: int | None
    ) -> list[list[int]]:
        token_ids = work()
        try:
            inputs.check_not_empty(token_ids)
        except ParamError as exc:  # (its own code: an empty input is not one too long)
            raise RequestInvalid(str(exc), exc.param, code="empty_input") from None
        try:
            inputs.check_lengths(token_ids, min(max_model_len, self.limits.max_prompt_tokens or max_model_len))
        except ParamError as exc:
            raise RequestInvalid(str(exc), exc.param, code="context_length_exceeded") from None
        self.limits.check_pooling(sum(len(ids) for ids in token_ids), values_per_token)
        return token_ids

    def _admit(
        self,
        key: Key,
        params: PoolingParams,
        token_ids: list[list[int]],
        engine: protocol.EngineReady,
        route: Callable[[list[int]], EngineReplica],
        arrival: float,
    ) -> None:
        replica = route(token_ids[0])
        engine_ids = [self.new_engine_id() for _ in token_ids]
        lengths = [len(ids) for ids in token_ids]
        pending = PendingEmbed(key[0], key[1], replica.index, engine_ids, lengths, params.task, arrival)
        self.by_client[key] = pending
        replica.sent_since_stats += len(token_ids)
        # The inputs form one batch in the engine, which lets batches take turns (a client's own
        # batch_id is replaced: it could otherwise join another client's batch).
        params = msgspec.structs.replace(params, batch_id=engine_ids[0] if len(engine_ids) > 1 else None)
        for index, (engine_id, ids) in enumerate(zip(engine_ids, token_ids, strict=True)):
            self.by_engine_id[engine_id] = (pending, index)
            replica.send(protocol.AddRequest(engine_id, protocol.pack_tokens(ids), _UNUSED, None, params))

    # ---- results ------------------------------------------------------------------------------
    def deliver(self, delta: protocol.RequestDelta) -> None:
        """An engine delta of a pooling request: its client is answered once all its inputs are done.
        Deltas of requests this does not know (aborted meanwhile) are dropped."""
        entry = self.by_engine_id.pop(delta.request_id, None)
        if entry is None or delta.pooled is None:  # (no vectors: the engine aborted it, and whoever
            return  # aborted it has told its client)
        pending, index = entry
        pending.outputs[index] = delta.pooled
        self.metrics.pooled(
            pending.replica, pending.num_prompt_tokens[index], pending.arrival, delta.queue_time, pending.task
        )
        if len(pending.outputs) == len(pending.engine_ids):
            del self.by_client[(pending.identity, pending.request_id)]
            outputs = [pending.outputs[i] for i in range(len(pending.engine_ids))]
            self.reply(pending.identity, protocol.EmbedResult(pending.request_id, outputs, pending.num_prompt_tokens))

    # ---- ending early -------------------------------------------------------------------------
    def abort(self, key: Key) -> tuple[int, list[str]] | None:
        """Forget a client's request: (its replica, the engine ids still running there), or None."""
        pending = self.by_client.pop(key, None)
        if pending is None:
            return None
        running = [e for e in pending.engine_ids if self.by_engine_id.pop(e, None) is not None]
        return pending.replica, running

    def owner(self, engine_id: str) -> Key | None:
        entry = self.by_engine_id.get(engine_id)
        return None if entry is None else (entry[0].identity, entry[0].request_id)

    def on_replica(self, index: int) -> list[Key]:
        """The client requests running on replica `index` (forgotten here: it went down)."""
        keys = [key for key, pending in self.by_client.items() if pending.replica == index]
        for key in keys:
            self.abort(key)
        return keys
