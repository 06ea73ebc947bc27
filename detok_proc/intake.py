"""Client requests that need the tokenizer: checked, tokenized (inline, or on the background thread for a
long prompt: tokenizing.py) and admitted to an engine replica; generation requests (generation.py),
embedding requests (pooling.py), and /tokenize and /detokenize, answered here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagoda.detok_proc.ending import RequestEnding
from pagoda.detok_proc.generation import GenerationFrontend
from pagoda.detok_proc.limits import FrontendLimits
from pagoda.detok_proc.pooling import PoolingFrontend
from pagoda.detok_proc.replica_set import ReplicaSet
from pagoda.detok_proc.requests import RequestInvalid, check_context, check_request_options
from pagoda.detok_proc.tokenizing import PromptTokenizer
from pagoda.engine_core import protocol
from pagoda.engine_core.validation import ParamError, check_token_ids


class Intake:
    def __init__(
        self,
        tokenizer,
        prompts: PromptTokenizer,
        limits: FrontendLimits,
        engines: ReplicaSet,
        generations: GenerationFrontend,
        pooling: PoolingFrontend,
        ending: RequestEnding,
        reply: Callable[[bytes, object], None],
    ):
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.limits = limits
        self.engines = engines
        self.generations = generations
        self.pooling = pooling
        self.ending = ending
        self.reply = reply

    def start(self, identity: bytes, request: protocol.GenerateRequest) -> None:
        """Check what needs no tokens, then tokenize (inline, or in the background for a long prompt)
        and admit the request (`_admit`)."""
        arrival = time.monotonic()
        engine = self.engines.require_engine()
        if engine.pooling is not None:
            raise RequestInvalid(
                "This model is an embedding model: it does not generate text (use /v1/embeddings or /pooling).",
                "model",
                code="model_not_generative",
            )
        key = (identity, request.request_id)
        if self.generations.owns(key) or self.pooling.owns(key) or self.prompts.is_pending(key):
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        check_request_options(request, engine.vocab_size)
        self.prompts.tokenize(
            key,
            request,
            engine.vocab_size,
            self._token_limit(engine),
            lambda ids: self._admit(key, request, ids, arrival),
        )

    def start_pooling(self, identity: bytes, request: protocol.EmbedRequest) -> None:
        engine = self.engines.require_engine()
        if self.generations.owns((identity, request.request_id)):
            raise RequestInvalid(f"request id {request.request_id!r} is already in use", "request_id")
        route = lambda ids: self.engines.route(ids, None, engine.block_size)  # noqa: E731
        self.pooling.start(identity, request, engine, route, self._num_pending())

    def _num_pending(self) -> int:
        """Engine requests running or queued: samples of generation requests, inputs of embedding ones."""
        return self.generations.num_engine_requests + self.pooling.num_engine_requests

    def _token_limit(self, engine: protocol.EngineReady) -> int:
        return min(engine.max_model_len, self.limits.max_prompt_tokens or engine.max_model_len)

    def background_done(self) -> None:
        """Continue the requests whose background tokenization has finished (unless aborted since)."""
        for (identity, request_id), then, result, error in self.prompts.finished():
            try:
                if error is not None:
                    raise error
                then(result)
            except RequestInvalid as exc:
                self.ending.abort(identity, [request_id])
                self.reply(identity, exc.to_message(request_id))
            except Exception as exc:  # noqa: BLE001 - answered as a server error, the loop goes on
                self.ending.failed(identity, request_id, exc)

    def _admit(self, key: tuple[bytes, str], request: protocol.GenerateRequest, ids: list[int], arrival: float) -> None:
        """Limits and context checks on the token count, then one engine request per sample."""
        engine = self.engines.require_engine()
        params = request.params
        prompt_param = "messages" if request.messages is not None else "prompt"
        self.limits.check(len(ids), params.n, self._num_pending(), prompt_param)
        self.limits.cap_max_tokens(params, len(ids), engine.max_model_len)
        check_context(len(ids), params.max_tokens, engine.max_model_len, prompt_param)
        replica = self.engines.route(ids, request.cache_salt, engine.block_size)  # every sample goes there
        self.generations.admit(key, request, ids, arrival, replica)

    def tokenize(self, identity: bytes, request: protocol.TokenizeRequest) -> None:
        try:
            engine = self.engines.require_engine()
        except RequestInvalid as exc:
            self.reply(identity, exc.to_message(request.request_id))
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
                lambda answer: self.reply(identity, answer),
                result,
            )
        except RequestInvalid as exc:
            self.reply(identity, exc.to_message(request.request_id))

    def detokenize(self, identity: bytes, request: protocol.DetokenizeRequest) -> None:
        ids = protocol.unpack_tokens(request.tokens)
        try:
            check_token_ids(ids, len(self.tokenizer), "tokens")
            self.prompts.run(
                (identity, request.request_id),
                4 * len(ids),  # ~4 bytes of text per token
                lambda: protocol.DetokenizeResult(request.request_id, self.tokenizer.decode(ids)),
                lambda answer: self.reply(identity, answer),
            )
        except ParamError as exc:
            self.reply(identity, RequestInvalid.of(exc).to_message(request.request_id))
        except RequestInvalid as exc:
            self.reply(identity, exc.to_message(request.request_id))
