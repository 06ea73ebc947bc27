"""The OpenAI-compatible HTTP API (aiohttp): one worker process, a client of the frontend socket.

Handlers parse and type-check the body, turn it into a GenerateRequest for the tokenizer process, and
answer with a JSON body or an SSE stream. A client that disconnects cancels its handler (aiohttp's
handler cancellation), which closes the generate stream and so aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from pagoda.api_proc.auth import AuthPolicy
from pagoda.api_proc.client import AsyncEngineClient, EngineError
from pagoda.api_proc.embeddings import EmbeddingRequest, PoolingRequest, embeddings_response, pooling_response
from pagoda.api_proc.http_guard import ClosingResponse
from pagoda.api_proc.json_reply import send_json
from pagoda.api_proc.metrics import count_rejected, count_timed_out
from pagoda.api_proc.metrics import install as install_metrics
from pagoda.api_proc.middleware import CorsSettings, auth_middleware, install_cors, preflight_middleware
from pagoda.api_proc.openai_format import (
    Choice,
    CompletionLogprobs,
    chat_logprobs,
    envelope,
    finish_reason,
    new_id,
    prompt_logprobs_json,
    usage,
)
from pagoda.api_proc.openai_schema import (
    MAX_N,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagoda.api_proc.openapi import install as install_openapi
from pagoda.api_proc.request_body import decode_json, read_body
from pagoda.api_proc.request_log import RequestRecord, logged, observed
from pagoda.api_proc.request_trace import HttpTracing
from pagoda.api_proc.streams import merge
from pagoda.api_proc.structured import check_constraint_size, structured_outputs_of
from pagoda.api_proc.tool_parsing import ToolCallStream, tool_response
from pagoda.api_proc.tools import plan_tools
from pagoda.api_proc.web_ui import install_dashboard_data, install_pages
from pagoda.engine_core import protocol
from pagoda.engine_core.identity import PAGODA_VERSION
from pagoda.engine_core.structured_limits import StructuredOutputLimits
from pagoda.engine_core.validation import ParamError, check_token_ids

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def request_timed_out(timeout: float) -> ApiError:
    """The 504 a request past --request-timeout gets (its count is the caller's)."""
    return ApiError(
        504,
        f"The request did not finish within this server's limit of {timeout:g} s.",
        error_type="server_error",
        code="request_timeout",
    )


@dataclass
class ApiSettings:
    frontend_addr: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    health_timeout: float = 5.0
    auth: AuthPolicy = field(default_factory=AuthPolicy)
    cors: CorsSettings | None = None
    max_n: int = MAX_N
    request_timeout: float | None = None  # seconds, end to end
    body_timeout: float | None = 30.0  # seconds a request body may go without a byte arriving
    header_timeout: float | None = 30.0  # seconds a connection has to deliver a request head
    keepalive_timeout: float = 75.0  # seconds an idle keep-alive connection stays open
    max_connections: int | None = 1024  # open connections per worker (api_proc/http_guard.py)
    max_tokens_cap: int | None = None  # the server's largest max_tokens (enforced by the tokenizer process)
    log_requests: bool = False  # put prompts into the per-request log lines
    ui: bool = True  # serve the web app at / (api_proc/web_ui.py; --no-ui)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces (api_proc/request_trace.py)
    # The largest structured-output constraint (the engine checks it too, for direct clients).
    structured_limits: StructuredOutputLimits = field(default_factory=StructuredOutputLimits)

    def completion_max_tokens(self) -> int:
        """OpenAI's default max_tokens for /v1/completions (16), or the server's cap if lower."""
        return 16 if self.max_tokens_cap is None else min(16, self.max_tokens_cap)


def json_response(
    body, status: int = 200, headers: dict | None = None, response_class: type[web.Response] = web.Response
) -> web.Response:
    return response_class(body=_json.encode(body), status=status, content_type="application/json", headers=headers)


def error_response(error: ApiError) -> web.Response:
    if error.status in (413, 429):
        count_rejected(error.status)
    response = json_response(
        error.body(), error.status, error.headers, ClosingResponse if error.closes == "now" else web.Response
    )
    if error.closes == "after_body":
        response.force_close()
    return response


def _engine_error(exc: EngineError) -> ApiError:
    error_type = exc.type if exc.status < 500 else "server_error"
    headers = {"Retry-After": "1"} if exc.status == 429 else None  # full now; capacity frees up quickly
    return ApiError(exc.status, exc.message, exc.param, exc.code, error_type, headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every failure leaves as OpenAI's error envelope, with the right status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except EngineError as exc:
        return error_response(_engine_error(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(ApiError(413, f"The request body is too large ({exc.text}).", code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(
            ApiError(
                exc.status,
                f"{exc.reason}: {request.method} {request.path}",
                code="not_found" if exc.status == 404 else None,
                headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None,  # 405 (RFC 9110)
            )
        )
    except OverflowError as exc:  # an integer too large to cross to the engine
        return error_response(
            ApiError(400, f"A number in the request is out of range: {exc}.", code="integer_above_max_value")
        )
    except asyncio.TimeoutError:  # (TimeoutError's alias from Python 3.11)
        return error_response(
            ApiError(503, "The tokenizer process did not answer in time.", error_type="server_error", code="timeout")
        )
    except Exception:  # a bug must still answer in OpenAI's shape, not plain text
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(
            ApiError(500, "Internal server error (the server log has the details).", error_type="server_error")
        )


class ApiServer:
    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.model = settings.served_model_names[0]
        self.client = AsyncEngineClient(settings.frontend_addr)
        endpoint = settings.otlp_traces_endpoint
        self.tracing = HttpTracing(endpoint, self.model) if endpoint else None
        self.serving = False  # set once the parent says every process is ready
        self.draining = False
        self.active_requests = 0  # generation handlers running now
        middlewares = [openai_errors, auth_middleware(settings.auth)]
        if settings.cors is not None:
            middlewares.insert(0, preflight_middleware(settings.cors))
        self.app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
        if settings.cors is not None:
            install_cors(self.app, settings.cors)
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/load", self.load),
                web.get("/version", self.version),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/embeddings", self.embeddings),
                web.post("/pooling", self.pooling),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
            ]
        )
        if self.tracing is not None:
            self.app.on_cleanup.append(self.tracing.on_cleanup)
        install_metrics(self.app, self.client)  # GET /metrics (api_proc/metrics.py)
        install_dashboard_data(self.app, self.client)  # GET /dashboard.json (api_proc/web_ui.py)
        if settings.ui:
            install_pages(self.app)  # GET / and /ui/...
        install_openapi(self.app, settings.auth, with_pages=settings.ui)  # GET /openapi.json (api_proc/openapi.py)

    # ---- small routes ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.serving:
            return json_response({"status": "starting", "message": "the model is loading"}, 503)
        if self.draining:
            return json_response({"status": "draining"}, 503)
        try:
            report = await self.client.health(self.settings.health_timeout)
        except asyncio.TimeoutError:
            return json_response({"status": "unhealthy", "message": "the tokenizer process does not answer"}, 503)
        # Degraded (a data-parallel replica down or restarting while others serve) is still 200: the
        # server answers requests, so a readiness probe keeps it in rotation and a liveness probe does
        # not restart what the launcher is already restarting; monitoring reads "status" or engine_up.
        body = {
            "status": "unhealthy" if not report.healthy else "degraded" if report.degraded else "ok",
            "message": report.message,
            "seconds_since_engine_progress": round(report.seconds_since_engine_progress, 3),
        }
        if len(report.engines) > 1:
            body["engines"] = [
                {"index": e.index, "state": e.state, "message": e.message, "num_running": e.num_running}
                for e in report.engines
            ]
        return json_response(body, 200 if report.healthy else 503)

    async def load(self, request: web.Request) -> web.Response:
        """What a router balancing over several servers reads every 250 ms (api_proc/router): running and
        waiting requests and KV-cache usage, over every engine replica. Cheap: the tokenizer process
        answers from the scheduler stats the engines sent with their latest step (what /metrics shows
        too); nothing reaches an engine."""
        report = await self.client.health(self.settings.health_timeout)
        return json_response(
            {"running": report.num_running, "waiting": report.num_waiting, "kv_cache_usage": report.kv_cache_usage}
        )

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": PAGODA_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        report = await self.client.health(self.settings.health_timeout)
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "pagoda",
                "root": report.model,
                "max_model_len": report.max_model_len,
                # Pagoda's own fields: how the weights are stored (null: full precision), and their size
                "quantization": report.quantization,
                "weight_bytes": report.weight_bytes,
            }
            for name in self.settings.served_model_names
        ]
        return json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = decode_json(await self._body(request), TokenizeRequest)
        self._check_model(body.model)
        chat = body.chat_request()
        if chat is None:
            result = await self.client.tokenize(
                body.prompt, add_special_tokens=body.add_special_tokens, return_token_strs=body.return_token_strs
            )
        else:  # the prompt a chat completion would see: template variables and tools included
            tools = plan_tools(chat.tools, None)
            options = protocol.ChatOptions(
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=chat.chat_template_kwargs or {},
                tools=tools.template_tools if tools else None,
            )
            result = await self.client.tokenize(
                messages=chat.template_messages(), chat=options, return_token_strs=body.return_token_strs
            )
        tokens = protocol.unpack_tokens(result.tokens)
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": result.max_model_len,
                "tokens": tokens,
                "token_strs": result.token_strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = decode_json(await self._body(request), DetokenizeRequest)
        self._check_model(body.model)
        tokens = body.tokens
        try:
            check_token_ids(tokens, None, "tokens")
        except ParamError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_type") from None
        return json_response({"prompt": await self.client.detokenize(tokens)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Admin: forget every cached prefix (e.g. after changing what tenants may share)."""
        return json_response({"status": "ok", "num_blocks": await self.client.reset_prefix_cache()})

    async def _body(self, request: web.Request) -> bytes:
        return await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)

    def _check_model(self, model: str | None) -> str:
        if model is not None and model not in self.settings.served_model_names:
            raise ApiError(
                404, f"The model `{model}` does not exist or you do not have access to it.", "model", "model_not_found"
            )
        return self.model if model is None else model

    def _check_accepting(self) -> None:
        if not self.serving:
            raise ApiError(
                503, "The server is starting; try again shortly.", error_type="server_error", code="not_ready"
            )
        if self.draining:
            raise ApiError(
                503,
                "The server is shutting down and accepts no new requests.",
                error_type="server_error",
                code="server_shutting_down",
            )

    def _limited(self, params):
        """The server's cap on n and its size limits on a constraint (the max_tokens cap needs the
        prompt's length: the tokenizer process applies it, for direct clients too)."""
        if params.structured_outputs is not None:
            check_constraint_size(params.structured_outputs, self.settings.structured_limits)
        if params.n > self.settings.max_n:
            raise ApiError(
                400,
                f"Invalid 'n': this server allows at most {self.settings.max_n}, but got {params.n}.",
                "n",
                "integer_above_max_value",
            )
        return params

    async def _deadline(self, deltas):
        """`deltas`, ended with a 504 once the request has run for `request_timeout` seconds (leaving the
        `aclosing` block then closes the stream, which aborts the request in the engine)."""
        timeout = self.settings.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        async with aclosing(deltas):  # closed with us, at once: that is what aborts the request
            iterator = deltas.__aiter__()
            loop = asyncio.get_running_loop()
            while True:
                try:
                    if deadline is None:
                        item = await iterator.__anext__()
                    elif loop.time() >= deadline:  # queued deltas never suspend: a wait alone would miss this
                        raise asyncio.TimeoutError
                    else:
                        item = await asyncio.wait_for(iterator.__anext__(), deadline - loop.time())
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                    count_timed_out()
                    raise request_timed_out(timeout) from None
                yield item

    # ---- generation --------------------------------------------------------------------------
    async def _generation(self, request: web.Request, endpoint: str, id_prefix: str, run) -> web.StreamResponse:
        """Run a generation route: `run(request, record)`, counted as in flight (shutdown waits for
        it) and logged once however it ends: answered, refused from body parsing on, failed, or left."""
        record = RequestRecord(new_id(id_prefix), endpoint)
        # (traced outside logged: the span ends once the record knows how the request ended)
        with HttpTracing.traced(self.tracing, request, record), logged(record):
            self._check_accepting()
            self.active_requests += 1
            try:
                return await run(request, record)
            finally:
                self.active_requests -= 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "completions", "cmpl", self._completions)

    async def _completions(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        req = decode_json(await self._body(request), CompletionRequest)
        record.prompt = req.prompt if self.settings.log_requests else None
        model = self._check_model(req.model)
        record.request = req
        prompts = req.prompts()
        max_tokens = self.settings.completion_max_tokens() if req.max_tokens is None else req.max_tokens
        params = self._limited(
            req.sampling_params(max_tokens, req.logprobs, structured_outputs_of(req), req.prompt_logprobs_count())
        )
        streams = [
            self.client.generate(
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else p,
                params=params,
                stop=req.stop_list,
                include_stop_str_in_output=req.include_stop_str_in_output,
                add_special_tokens=req.add_special_tokens,
                return_prompt=req.echo,
                cache_salt=req.cache_salt,
                trace_context=record.trace_context,
            )
            for p in prompts
        ]
        meta = dict(response_id=record.request_id, model=model)
        async with aclosing(observed(self._deadline(merge(streams)), record)) as deltas:
            if req.stream:
                return await self._stream_completions(request, req, deltas, meta)
            return await self._complete(req, deltas, meta, params.n)

    async def _complete(self, req: CompletionRequest, deltas, meta: dict, n: int) -> web.Response:
        choices: dict[int, Choice] = {}
        prompts: dict[int, str] = {}
        async for prompt_index, delta in deltas:
            index = prompt_index * n + delta.index
            choices.setdefault(index, Choice()).add(delta)
            if delta.prompt is not None:
                prompts[prompt_index] = delta.prompt
        # Sample 0 of each prompt carries its prompt logprobs; every choice of the prompt shows them (vLLM).
        prompt_logprobs = {i // n: c.prompt_logprobs for i, c in choices.items() if c.prompt_logprobs is not None}
        prompt_logprobs_shown = {p: prompt_logprobs_json(d) for p, d in prompt_logprobs.items()}
        out = []
        for index in sorted(choices):
            choice = choices[index]
            logprobs = None
            if req.logprobs is not None:
                echo = prompt_logprobs.get(index // n) if req.echo else None
                logprobs = CompletionLogprobs().chunk(choice.logprob_entries, echo, req.logprobs)
            body = {
                "index": index,
                "text": prompts.get(index // n, "") + choice.text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if req.prompt_logprobs_count() is not None:
                body["prompt_logprobs"] = prompt_logprobs_shown.get(index // n)
            out.append(body)
        firsts = [choices[p * n] for p in range(len(choices) // n)]
        completion_tokens = sum(c.num_output_tokens for c in choices.values())
        return json_response(
            envelope(
                "text_completion",
                meta["response_id"],
                meta["model"],
                choices=out,
                usage=usage(
                    sum(c.num_prompt_tokens for c in firsts),
                    completion_tokens,
                    sum(c.num_cached_tokens for c in firsts),
                ),
            )
        )

    async def _stream_completions(self, request, req: CompletionRequest, deltas, meta: dict) -> web.StreamResponse:
        n = req.n
        offsets: dict[int, CompletionLogprobs] = {}
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        output_tokens: dict[int, int] = {}

        # Per prompt, for every choice's first chunk (echo): its text, and its logprobs (echo with logprobs).
        echoes: dict[int, str] = {}
        echo_logprobs: dict[int, protocol.DecodedPromptLogprobs] = {}
        echoed: set[int] = set()

        def chunk(prompt_index: int, delta: protocol.GenerateDelta) -> dict:
            index = prompt_index * n + delta.index
            prompt_tokens[prompt_index] = delta.num_prompt_tokens
            if delta.index == 0:
                cached_tokens[prompt_index] = delta.num_cached_tokens
            output_tokens[index] = delta.num_output_tokens
            if delta.prompt is not None:
                echoes[prompt_index] = delta.prompt
            if delta.prompt_logprobs is not None:
                echo_logprobs[prompt_index] = delta.prompt_logprobs
            text = delta.text
            echo = None
            if req.echo and index not in echoed:
                echoed.add(index)
                text = echoes.get(prompt_index, "") + text
                echo = echo_logprobs.get(prompt_index)
            logprobs = None
            if req.logprobs is not None:
                logprobs = offsets.setdefault(index, CompletionLogprobs()).chunk(
                    delta.logprobs or [], echo, req.logprobs
                )
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(delta),
                "stop_reason": delta.stop_reason,
            }
            if delta.prompt_logprobs is not None:  # sample 0's first chunk (vLLM refuses them in streams)
                choice["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs)
            return envelope("text_completion", meta["response_id"], meta["model"], choices=[choice])

        def final() -> dict | None:
            if not req.include_usage:
                return None
            return envelope(
                "text_completion",
                meta["response_id"],
                meta["model"],
                choices=[],
                usage=usage(sum(prompt_tokens.values()), sum(output_tokens.values()), sum(cached_tokens.values())),
            )

        return await self._sse(request, deltas, chunk, final)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "embeddings", "embd", self._embeddings)

    async def pooling(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "pooling", "pool", self._pooling)

    async def _embeddings(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        req = decode_json(await self._body(request), EmbeddingRequest)
        model = self._check_model(req.model)
        record.prompt = req.input if self.settings.log_requests else None
        result = await self._embed(req.embed_options())
        record.prompt_tokens = dict(enumerate(result.num_prompt_tokens))
        return await send_json(request, embeddings_response(result, model, req.encoding_format))

    async def _pooling(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        req = decode_json(await self._body(request), PoolingRequest)
        model = self._check_model(req.model)
        record.prompt = req.input if self.settings.log_requests else None
        result = await self._embed(req.embed_options(req.task))
        record.prompt_tokens = dict(enumerate(result.num_prompt_tokens))
        return await send_json(request, pooling_response(result, record.request_id, model, req))

    async def _embed(self, options: dict) -> protocol.EmbedResult:
        """The tokenizer process's answer, or 504 once the request has run for `request_timeout` seconds
        (the wait is then cut short, which aborts the request)."""
        timeout = self.settings.request_timeout
        try:
            return await self.client.embed(**options, timeout=timeout)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            count_timed_out()
            raise request_timed_out(timeout) from None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "chat", "chatcmpl", self._chat)

    async def _chat(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        req = decode_json(await self._body(request), ChatCompletionRequest)
        record.prompt = req.messages if self.settings.log_requests else None
        model = self._check_model(req.model)
        record.request = req
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)  # None: no tool to call
        constraint = structured_outputs_of(req, tools)
        params = self._limited(req.sampling_params(max_tokens, req.logprobs_count(), constraint, req.prompt_logprobs))
        stream = self.client.generate(
            messages=req.template_messages(),
            params=params,
            stop=req.stop_list,
            include_stop_str_in_output=req.include_stop_str_in_output,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs or {},
            cache_salt=req.cache_salt,
            tools=tools.template_tools if tools else None,
            trace_context=record.trace_context,
        )
        meta = dict(response_id=record.request_id, model=model)
        async with aclosing(observed(self._deadline(merge([stream])), record)) as deltas:
            if req.stream:
                return await self._stream_chat(request, req, deltas, meta, tools)
            return await self._chat_complete(req, deltas, meta, tools)

    async def _chat_complete(self, req: ChatCompletionRequest, deltas, meta: dict, tools) -> web.Response:
        choices: dict[int, Choice] = {}
        async for _, delta in deltas:
            choices.setdefault(delta.index, Choice()).add(delta)
        out = []
        for index in sorted(choices):
            choice = choices[index]
            logprobs = {"content": chat_logprobs(choice.logprob_entries)} if req.logprobs else None
            message, reason = {"role": "assistant", "content": choice.text}, choice.finish_reason
            if tools is not None:  # the output may be tool calls (api_proc/tool_parsing.py)
                message, reason = tool_response(tools, choice.text, reason)
            out.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        first = choices[0]
        completion_tokens = sum(c.num_output_tokens for c in choices.values())
        extra = {}
        if req.prompt_logprobs is not None:  # vLLM: one list, beside the choices (sample 0 computed it)
            extra["prompt_logprobs"] = prompt_logprobs_json(first.prompt_logprobs) if first.prompt_logprobs else None
        return json_response(
            envelope(
                "chat.completion",
                meta["response_id"],
                meta["model"],
                choices=out,
                usage=usage(first.num_prompt_tokens, completion_tokens, first.num_cached_tokens),
                **extra,
            )
        )

    async def _stream_chat(self, request, req: ChatCompletionRequest, deltas, meta: dict, tools) -> web.StreamResponse:
        started: set[int] = set()
        tool_streams: dict[int, ToolCallStream] = {}
        counts = {"prompt": 0, "cached": 0}
        output_tokens: dict[int, int] = {}

        def chunk(_: int, delta: protocol.GenerateDelta) -> dict:
            counts["prompt"] = delta.num_prompt_tokens
            if delta.index == 0:
                counts["cached"] = delta.num_cached_tokens
            output_tokens[delta.index] = delta.num_output_tokens
            message, reason = {"content": delta.text}, finish_reason(delta)
            if tools is not None:  # tool calls stream as OpenAI's delta.tool_calls
                stream = tool_streams.setdefault(delta.index, ToolCallStream(tools))
                message, reason = stream.step(delta.text, reason)
            if delta.index not in started:
                started.add(delta.index)
                message = {"role": "assistant", **message}
            logprobs = {"content": chat_logprobs(delta.logprobs or [])} if req.logprobs else None
            choice = {
                "index": delta.index,
                "delta": message,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": delta.stop_reason,
            }
            extra = {}
            if delta.prompt_logprobs is not None:  # with sample 0's first chunk (vLLM refuses them in streams)
                extra["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs)
            return envelope("chat.completion.chunk", meta["response_id"], meta["model"], choices=[choice], **extra)

        def final() -> dict | None:
            if not req.include_usage:
                return None
            return envelope(
                "chat.completion.chunk",
                meta["response_id"],
                meta["model"],
                choices=[],
                usage=usage(counts["prompt"], sum(output_tokens.values()), counts["cached"]),
            )

        return await self._sse(request, deltas, chunk, final)

    async def _sse(self, request: web.Request, deltas, chunk, final) -> web.StreamResponse:
        """Stream `chunk(prompt_index, delta)` per delta as server-sent events, then `final()` and
        [DONE]. Errors before the first delta are answered with their HTTP status; later ones as an
        error event (the status line has gone out by then)."""
        iterator = deltas.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(b"data: " + _json.encode(chunk(*first)) + b"\n\n")
                async for item in iterator:
                    await response.write(b"data: " + _json.encode(chunk(*item)) + b"\n\n")
            last = final()
            if last is not None:
                await response.write(b"data: " + _json.encode(last) + b"\n\n")
        except (EngineError, ApiError) as exc:
            error = _engine_error(exc) if isinstance(exc, EngineError) else exc
            await response.write(b"data: " + _json.encode(error.body()) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
