"""The HTTP connection layer's defences, below the routes: what aiohttp's own protocol handler leaves open.

- Requests that are not valid HTTP (bad framing, over-long lines, unknown methods, TLS on the plain
  port, too many headers) get OpenAI's JSON error envelope with a fixed message per kind of fault.
  aiohttp would answer in plain text that quotes the offending bytes, an `Authorization` header's
  included, and log a traceback for each; here nothing a client sent is ever echoed, and the log gets
  one WARNING line per kind at most every `LOG_INTERVAL` seconds, with a count of the rest.
- A header timeout: a connection must deliver a complete request head within `header_timeout`
  seconds of opening, or of the first byte after a finished request; otherwise it gets a 408 and is
  closed (quietly, if it sent nothing at all). Idle keep-alive connections are closed after aiohttp's
  `keepalive_timeout`. (Bodies have their own timeouts: api_proc/request_body.py.)
- A cap on open connections per worker. At the cap, the connection that has waited longest for its next
  request is closed to make room; when every connection is busy with a request, a new one gets a 503
  and is closed at once (so it holds no file descriptor).

- `Expect`: `100-continue` is answered by aiohttp's routes as usual; any other expectation gets a JSON
  417 before the request reaches the app, whatever its path (aiohttp's own is plain text that quotes
  the header, raised before any middleware could turn it into JSON).

`GuardedAppRunner` is aiohttp's AppRunner with its protocol handler replaced by `GuardedRequestHandler`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web, web_protocol
from aiohttp.http_exceptions import (
    BadHttpMethod,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)

logger = logging.getLogger("pagoda.http")
LOG_INTERVAL = 10.0  # seconds between two log lines about the same kind of bad request
# A refused connection gets its 503, then up to this long for the client to read it (closing at once,
# with its request unread, would send a reset that can destroy the answer); at most this many at a time.
REFUSED_LINGER_S = 1.0
MAX_LINGERING = 64

_FRAMING = "The request's body framing is not valid (Content-Length and Transfer-Encoding)."
_KNOWN_MESSAGES = {  # aiohttp messages that quote nothing of the request, and what we answer for them
    "Too many headers received": "The request has too many header fields.",
    "Transfer-Encoding can't be present with Content-Length": _FRAMING,
    "Received HTTPS traffic on an HTTP port": "This port speaks plain HTTP, not HTTPS.",
}


OTHER_FILES = 256  # sockets to the tokenizer process or backends' probes, libraries, logs: besides connections


def allow_open_files(connections: int | None, files_per_connection: int = 1) -> int | None:
    """Raise the soft limit on open files so that the connection cap, not EMFILE, is what refuses
    clients (a failing accept() is retried and logged by asyncio in a loop). Returns the cap to use:
    `connections`, or less when the hard limit leaves less room. `files_per_connection`: 2 for a proxy,
    whose every client connection may hold one to a backend."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and (
        connections is None or connections * files_per_connection + OTHER_FILES > hard
    ):
        fitting = max(1, (hard - OTHER_FILES) // files_per_connection)
        logger.warning(
            "the open-file limit (%d) leaves room for %d connections: the cap is %d, not %s",
            hard,
            fitting,
            fitting,
            connections,
        )
        connections = fitting
    if connections is None:  # no cap, and no hard limit to keep under
        return None
    wanted = connections * files_per_connection + OTHER_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return connections


@dataclass
class HttpGuard:
    """One HTTP worker's connection limits, and the state they need (shared by its connections)."""

    header_timeout: float | None = 30.0
    max_connections: int | None = 1024
    connections: set = field(default_factory=set)  # the open connections this worker accepted
    lingering: int = 0  # refused connections waiting for their client to read the 503
    _last_logged: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def admit(self, connection: GuardedRequestHandler) -> bool:
        """Room for a new connection. At the cap, the connection that has waited longest for its next
        request (an idle keep-alive one, or one whose request head is still arriving) is closed to make
        room, as nginx does; when every connection is busy with a request, the new one is refused."""
        if self.max_connections is not None and len(self.connections) >= self.max_connections:
            waiting = [c for c in self.connections if c.waiting_for_request()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c.last_activity)
            self.connections.discard(oldest)
            oldest.force_close()
        self.connections.add(connection)
        return True

    def warn(self, kind: str, message: str) -> None:
        """One WARNING line per `kind` every LOG_INTERVAL seconds, counting the ones left out."""
        now = time.monotonic()
        if now - self._last_logged.get(kind, -LOG_INTERVAL) < LOG_INTERVAL:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last_logged[kind] = now
        left_out = self._suppressed.pop(kind, 0)
        logger.warning(
            "%s%s", message, f" ({left_out} more like it in the last {LOG_INTERVAL:g} s)" if left_out else ""
        )


def parse_error_message(exc: BaseException | None) -> str:
    """A fixed description of an HTTP parsing fault, chosen by its kind; never the client's bytes."""
    if isinstance(exc, LineTooLong):
        return "The request line or a header field is too long."
    if isinstance(exc, HttpProcessingError):
        known = _KNOWN_MESSAGES.get(str(exc.message).split(":")[0].strip())
        if known:
            return known
    if isinstance(exc, BadHttpMethod):
        return "The request method is not an HTTP method this server knows."
    if isinstance(exc, InvalidURLError):
        return "The request target is not a valid URL."
    if isinstance(exc, InvalidHeader):
        return "A request header is not valid HTTP."
    if isinstance(exc, ContentEncodingError):
        return "The request's Content-Encoding is not supported."
    if isinstance(exc, (TransferEncodingError, ContentLengthError)):
        return _FRAMING
    return "The request is not valid HTTP/1.1."


def raw_error(
    status: int,
    reason: str,
    message: str,
    code: str,
    error_type: str = "invalid_request_error",
    extra_headers: str = "",
) -> bytes:
    """A complete HTTP/1.1 error response (JSON, connection closing), for writing to a transport."""
    body = msgspec.json.encode({"error": {"message": message, "type": error_type, "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{extra_headers}Connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedRequestHandler(web_protocol.RequestHandler):
    """aiohttp's per-connection protocol, with the guards above."""

    def __init__(self, manager: web.Server, guard: HttpGuard, **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.last_activity = 0.0  # loop time of the last byte received (or of opening)
        self._header_timer: asyncio.TimerHandle | None = None
        self._head_arriving = False  # bytes arrived since the last complete request head
        self._refused = False
        self._linger: asyncio.TimerHandle | None = None  # a refused connection's deadline to close

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.last_activity = self._loop.time()
        if self.guard.admit(self):
            self._start_header_timer()
        else:
            self._refuse(transport)

    def _refuse(self, transport) -> None:
        """503 and close: at once when many are already lingering, else once the client has read it."""
        self.guard.warn(
            "too_many_connections",
            "refused a connection: every connection is busy with a request "
            f"(--max-connections {self.guard.max_connections})",
        )
        self._refused = True
        transport.write(
            raw_error(
                503,
                "Service Unavailable",
                "This server has too many open connections; retry shortly.",
                "too_many_connections",
                "server_error",
                "Retry-After: 1\r\n",
            )
        )
        if self.guard.lingering >= MAX_LINGERING or not transport.can_write_eof():
            self.force_close()
            return
        self.guard.lingering += 1
        transport.write_eof()  # the answer, then FIN; what the client sends is read and dropped
        self._linger = self._loop.call_later(REFUSED_LINGER_S, self.force_close)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self.guard.lingering -= 1
        self.guard.connections.discard(self)
        self._stop_header_timer()
        super().connection_lost(exc)

    def waiting_for_request(self) -> bool:
        """Between requests: the loop waits for the next request head (none queued)."""
        return self._waiter is not None and not self._waiter.done() and not self._messages

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read, so that closing sends no reset; never parsed
        self.last_activity = self._loop.time()
        self._head_arriving = True
        if self.waiting_for_request():  # the first byte of a request starts the header clock
            self._start_header_timer()
        super().data_received(data)
        if self._messages:  # a request head is complete (or was refused): the clock stops
            self._head_arriving = False
            self._stop_header_timer()

    def _start_header_timer(self) -> None:
        timeout = self.guard.header_timeout
        if timeout is not None and self._header_timer is None:
            self._header_timer = self._loop.call_later(timeout, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport is None or self._force_close or not self.waiting_for_request():
            return  # closed already, or a request is being handled: its head did arrive in time
        if self._head_arriving:  # part of a head: say why before closing
            self.guard.warn(
                "header_timeout",
                f"closed a connection that sent no complete request head within {self.guard.header_timeout:g} s",
            )
            self.transport.write(
                raw_error(
                    408,
                    "Request Timeout",
                    f"The request head did not arrive within {self.guard.header_timeout:g} s.",
                    "request_timeout",
                )
            )
        self.force_close()  # nothing at all: close quietly (a pool's spare connection needs no answer)

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (400) or a failure outside every route (500): JSON, no
        echo of the request, and at most one log line per kind and interval."""
        if status == 400:
            text = parse_error_message(exc)
            self.guard.warn(f"bad_http:{type(exc).__name__}", f"refused a request that is not valid HTTP: {text}")
            code, error_type = "invalid_http_request", "invalid_request_error"
        else:
            if status >= 500:
                logger.error("request failed outside the API's handlers", exc_info=exc)
            text, code, error_type = "The server could not complete this request.", None, "server_error"
        if request.writer.output_size > 0:  # the response has begun; only closing is left
            raise ConnectionError("the response has begun; closing the connection")
        response = web.Response(
            body=msgspec.json.encode({"error": {"message": text, "type": error_type, "param": None, "code": code}}),
            status=status,
            content_type="application/json",
        )
        response.force_close()
        return response


def expectation_failed(request: web.BaseRequest) -> web.Response | None:
    """The 417, in OpenAI's envelope, for an `Expect` other than `100-continue` (which the app's routes
    answer); None for a request without one, or on HTTP/1.0, which has no Expect."""
    expect = request.headers.get("Expect")
    if not expect or expect.lower() == "100-continue" or request.version < (1, 1):
        return None
    body = msgspec.json.encode(
        {
            "error": {
                "message": "Only 'Expect: 100-continue' is supported.",
                "type": "invalid_request_error",
                "param": None,
                "code": "expectation_failed",
            }
        }
    )
    response = web.Response(status=417, body=body, content_type="application/json")
    response.force_close()  # the body the client holds back is never read
    return response


class ClosingResponse(web.Response):
    """A response after which its connection closes at once: no keep-alive, and no lingering to read
    the rest of a request body that is stalled or cannot be decoded."""

    async def prepare(self, request: web.BaseRequest):
        self.force_close()
        self._closing = request
        return await super().prepare(request)

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(data)
        self._closing.protocol.force_close()  # the transport flushes what is written, then closes


class GuardedServer(web.Server):
    """An aiohttp Server whose connections get a GuardedRequestHandler."""

    guard: HttpGuard

    @classmethod
    def wrapping(cls, server: web.Server, guard: HttpGuard) -> GuardedServer:
        guarded = cls.__new__(cls)
        guarded.__dict__.update(server.__dict__)  # the app's handler, request factory and settings
        guarded.guard = guard
        app_handler = server.request_handler

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            refused = expectation_failed(request)  # (the app would answer it before its middlewares)
            return refused if refused is not None else await app_handler(request)

        guarded.request_handler = handle
        return guarded

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, self.guard, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    def __init__(self, app: web.Application, guard: HttpGuard, **kwargs):
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        return GuardedServer.wrapping(await super()._make_server(), self.guard)
