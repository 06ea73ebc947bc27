"""The router's HTTP side (aiohttp): OpenAI routes forwarded to a backend, its own /health and /metrics.

A request's body is read once (within --max-body-size and --body-timeout, api_proc/request_body.py) and
sent to the backend the policy picks. What happens next:
- No connection (refused, connect timeout) or the connection closed before any answer, or an answer of
  429 or 503 (busy, starting, draining) while another backend is left to try: the next backend is
  tried. Nothing has reached the client yet, so a retry cannot duplicate or mangle an answer. Each
  backend is tried at most once per request.
- No byte within --read-timeout: 504, not retried (the backend may be working on it).
- An answer: relayed with its status. Server-sent events go out as they arrive, each complete event
  written at once (never held for more); a backend that fails mid-stream ends the client's stream with
  an error event in OpenAI's shape and `data: [DONE]`. Other bodies are read whole, then sent.
- A client that disconnects cancels its handler (aiohttp's handler cancellation); the backend
  connection is then closed, which a Pagoda backend takes as an abort of the request.
Every error the router answers itself is in OpenAI's envelope.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
from aiohttp import web

from pagoda.api_proc.http_guard import ClosingResponse
from pagoda.api_proc.middleware import auth_middleware
from pagoda.api_proc.openai_schema import ApiError
from pagoda.api_proc.request_body import read_body
from pagoda.api_proc.router.backends import Backend, BackendPool
from pagoda.api_proc.router.metrics import CONTENT_TYPE, RouterMetrics
from pagoda.api_proc.router.policies import Picker, prefix_key
from pagoda.api_proc.router.settings import RouterSettings

logger = logging.getLogger("pagoda.router")
_json = msgspec.json.Encoder()

FORWARDED_ROUTES = (
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
)
RETRY_STATUSES = frozenset({429, 503})  # busy or unavailable: another backend may take it
RELAYED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")  # of a backend's answer
MAX_PARTIAL_EVENT = 1 << 20  # bytes of an unfinished event held back; beyond, relayed as they are
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _error_response(error: ApiError) -> web.Response:
    response_class = ClosingResponse if error.closes == "now" else web.Response
    response = response_class(
        body=_json.encode(error.body()), status=error.status, content_type="application/json", headers=error.headers
    )
    if error.closes == "after_body":
        response.force_close()
    return response


@web.middleware
async def router_errors(request: web.Request, handler):
    """Every failure leaves as OpenAI's error envelope."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "not_found" if exc.status == 404 else None
        return _error_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", code=code))
    except Exception as exc:  # a bug must still answer in OpenAI's shape
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(ApiError(500, f"Internal router error: {type(exc).__name__}", error_type="server_error"))


def _events_end(data: bytes) -> int:
    """Where the last complete server-sent event in `data` ends (0: none complete)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class _TryNext(Exception):
    """This backend failed before answering (or is busy): the request may go to another one."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RouterProxy:
    def __init__(
        self, settings: RouterSettings, pool: BackendPool, metrics: RouterMetrics, session: aiohttp.ClientSession
    ):
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.session = session
        self.picker = Picker(settings.policy, settings.seed)
        self.draining = False
        self.active_requests = 0
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=settings.connect_timeout, sock_read=settings.read_timeout
        )
        self.app = web.Application(
            client_max_size=settings.max_body_bytes, middlewares=[router_errors, auth_middleware(settings.auth)]
        )
        routes = [web.get("/health", self.health), web.get("/metrics", self.metrics_text)]
        routes += [web.route(method, path, self.forward) for method, path in FORWARDED_ROUTES]
        self.app.add_routes(routes)

    # ---- the router's own routes -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while any backend is in rotation ("ok": all are, "degraded": some), else 503."""
        states = [b.state() for b in self.pool.backends]
        up = sum(s["state"] == "up" for s in states)
        if self.draining:
            status = "draining"
        else:
            status = "ok" if up == len(states) else "degraded" if up else "unhealthy"
        body = {"status": status, "backends_up": up, "backends": states}
        return web.Response(
            body=_json.encode(body),
            status=200 if status in ("ok", "degraded") else 503,
            content_type="application/json",
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- forwarding ------------------------------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            raise ApiError(
                503,
                "The router is shutting down and accepts no new requests.",
                error_type="server_error",
                code="server_shutting_down",
            )
        self.active_requests += 1
        try:
            body = None
            if request.method == "POST":
                body = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)
            key = prefix_key(body) if self.settings.policy == "prefix" else None
            headers = self._request_headers(request)
            tried: set[Backend] = set()
            failures: list[str] = []
            while candidates := [b for b in self.pool.backends if b.up and b not in tried]:
                backend = self.picker.pick(candidates, key)
                tried.add(backend)
                try:
                    return await self._attempt(request, backend, body, headers, may_retry=len(candidates) > 1)
                except _TryNext as exc:
                    failures.append(exc.reason)
                    logger.info(
                        "%s %s: backend %s %s; trying another", request.method, request.path, backend.url, exc.reason
                    )
            raise self._failed_everywhere(failures)
        finally:
            self.active_requests -= 1

    def _request_headers(self, request: web.Request) -> dict[str, str]:
        """What the backend gets: the body's type, what the client accepts, and the router's own key for
        the backends (never the client's Authorization: that key is the router's)."""
        headers = {"Accept-Encoding": "identity", **self.pool.headers}
        for name in ("Content-Type", "Accept"):
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def _failed_everywhere(self, failures: list[str]) -> ApiError:
        if not failures:
            self.metrics.failed.labels("no_backend").inc()
            return ApiError(
                503,
                f"No backend is available: all {len(self.pool.backends)} are out of rotation (failing health "
                "checks); retry shortly.",
                error_type="server_error",
                code="no_backend",
                headers={"Retry-After": "1"},
            )
        self.metrics.failed.labels("backend_unreachable").inc()
        return ApiError(  # the backends' addresses stay in the router's log, not in clients' answers
            502,
            f"No backend could take the request (tried {len(failures)}: " + "; ".join(failures) + ").",
            error_type="server_error",
            code="backend_unreachable",
        )

    async def _attempt(
        self, request: web.Request, backend: Backend, body: bytes | None, headers: dict, may_retry: bool
    ) -> web.StreamResponse:
        """The request on `backend`, relayed to the client; _TryNext when it may go to another backend."""
        backend.in_flight += 1
        self.metrics.requests.labels(backend.url).inc()
        upstream = None
        try:
            try:
                upstream = await self.session.request(
                    request.method, backend.url + request.path_qs, data=body, headers=headers, timeout=self.timeout
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self.pool.failed(backend, "connect", f"cannot connect: {exc}")
                raise _TryNext(f"cannot connect ({type(exc).__name__})") from None
            except (aiohttp.ServerTimeoutError, asyncio.TimeoutError):
                raise self._timed_out(backend) from None
            except aiohttp.ClientError as exc:  # closed before answering: nothing of it reached the client
                self.pool.failed(backend, "disconnected", f"closed before answering: {type(exc).__name__}: {exc}")
                raise _TryNext(f"closed the connection before answering ({type(exc).__name__})") from None
            self.pool.succeeded(backend)
            if upstream.status >= 500:
                self.metrics.errors.labels(backend.url, "http_5xx").inc()
            if may_retry and upstream.status in RETRY_STATUSES:
                raise _TryNext(f"answered {upstream.status}")
            if upstream.content_type == "text/event-stream":
                return await self._relay_events(request, backend, upstream)
            return await self._relay_body(backend, upstream)
        finally:
            backend.in_flight -= 1
            if upstream is not None:
                upstream.close()  # a no-op once the body was read whole; else the connection goes (an abort)

    def _timed_out(self, backend: Backend) -> ApiError:
        timeout = self.settings.read_timeout
        self.pool.failed(backend, "timeout", f"sent nothing for {timeout:g} s")
        self.metrics.failed.labels("backend_timeout").inc()
        return ApiError(
            504,
            f"The backend sent nothing for {timeout:g} s (the router's --read-timeout).",
            error_type="server_error",
            code="backend_timeout",
        )

    def _relayed_headers(self, upstream: aiohttp.ClientResponse) -> dict[str, str]:
        return {name: upstream.headers[name] for name in RELAYED_HEADERS if name in upstream.headers}

    async def _relay_body(self, backend: Backend, upstream: aiohttp.ClientResponse) -> web.Response:
        try:
            data = await upstream.read()
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError):
            raise self._timed_out(backend) from None
        except aiohttp.ClientError as exc:
            raise self._broke_off(backend, exc) from None
        return web.Response(body=data, status=upstream.status, headers=self._relayed_headers(upstream))

    def _broke_off(self, backend: Backend, exc: BaseException) -> ApiError:
        """A backend that failed after it began answering."""
        if isinstance(exc, asyncio.TimeoutError):
            self.pool.failed(backend, "timeout", f"sent nothing for {self.settings.read_timeout:g} s mid-response")
            why = f"sent nothing for {self.settings.read_timeout:g} s"
        else:
            self.pool.failed(backend, "disconnected", f"failed mid-response: {type(exc).__name__}: {exc}")
            why = "closed the connection"
        self.metrics.failed.labels("backend_failed").inc()
        return ApiError(
            502, f"The backend failed while answering: it {why}.", error_type="server_error", code="backend_failed"
        )

    async def _relay_events(
        self, request: web.Request, backend: Backend, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Server-sent events as they arrive: each read's complete events are written at once; only the
        unfinished tail of an event waits for its end, so an error event never lands inside another."""
        response = web.StreamResponse(status=upstream.status, headers=self._relayed_headers(upstream))
        await response.prepare(request)
        partial = b""
        while True:
            try:
                data = await upstream.content.readany()
            except _UPSTREAM_ERRORS as exc:  # the backend's side only: client write errors propagate
                error = self._broke_off(backend, exc)
                await response.write(b"data: " + _json.encode(error.body()) + b"\n\ndata: [DONE]\n\n")
                break
            if not data:
                if partial:  # the backend ended without a final blank line: pass on what it sent
                    await response.write(partial)
                break
            if partial:
                data = partial + data
            end = _events_end(data)
            if end == len(data):
                partial = b""
            else:
                partial = data[end:]
                data = data[:end]
                if len(partial) > MAX_PARTIAL_EVENT:  # not events after all: relay as they come
                    data, partial = data + partial, b""
            if not partial and upstream.content.at_eof():  # the stream's end came with this read
                await response.write_eof(data)  # one write for both
                return response
            if data:
                await response.write(data)
        await response.write_eof()
        return response
