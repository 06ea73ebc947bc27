"""Reading and decoding request bodies: the one way every route gets its JSON.

- `read_body`: the body's bytes, decompressed per Content-Encoding, at most `max_bytes` after
  decompression (so a gzip bomb is a 413 like any large body). A client that stops sending mid-body
  for `idle_timeout` seconds, or drips it slower than MIN_BODY_RATE on average, gets a 408 rather
  than holding the connection. A body that does not decode as its Content-Encoding says is a 400,
  and so is a Content-Encoding other than one coding aiohttp decodes (`x-gzip`, `gzip, identity`,
  `gzip;q=1`): aiohttp would pass such a body on undecoded, to be misread as plain JSON.
- `decode_json`: nesting measured before parsing (engine_core/json_limits.py), then msgspec, with
  `null` meaning the same as an absent field: OpenAI allows `null` on its optional fields, and a
  client that sends `"max_tokens": null` means "the default", not "unbounded".
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pagoda.api_proc.openai_schema import ApiError, validation_error
from pagoda.api_proc.request_log import CLIENT_CLOSED
from pagoda.engine_core.json_limits import MAX_JSON_DEPTH, depth_message, too_deep_field

T = TypeVar("T")
# Bytes per second a body must average (after a first `idle_timeout` of grace): a byte every few
# seconds would otherwise hold a connection for as long as the client likes.
MIN_BODY_RATE = 1024
# The codings aiohttp decodes (its HTTP parser, case-insensitively), and "no coding".
DECODED_CODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
PLAIN_CODINGS = frozenset({"", "identity"})


async def read_body(request: web.Request, max_bytes: int, idle_timeout: float | None) -> bytes:
    _check_coding(request.headers.get("Content-Encoding", ""))
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)  # said up front: no need to read any of it
    body = bytearray()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        wait = None
        if idle_timeout is not None:
            deadline = started + idle_timeout + len(body) / MIN_BODY_RATE
            wait = min(idle_timeout, deadline - loop.time())
        try:
            if request.content.is_eof():  # the rest has arrived (a small body comes with its head): no timer
                chunk = await request.content.readany()
            elif wait is not None and wait <= 0:
                raise asyncio.TimeoutError
            else:
                chunk = await asyncio.wait_for(request.content.readany(), wait)  # wait None: no limit
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            raise ApiError(
                408,
                f"The request body arrived too slowly (a pause of {idle_timeout:g} s, or under "
                f"{MIN_BODY_RATE} bytes/s on average).",
                code="request_timeout",
                closes="now",
            ) from None
        except ConnectionError:  # the client went away mid-body: nobody reads an answer, nothing to log
            raise ApiError(
                CLIENT_CLOSED,
                "The client closed the connection before sending the whole body.",
                code="client_closed",
                closes="now",
            ) from None
        except web.RequestPayloadError as exc:  # e.g. "Content-Encoding: gzip" on a body that is not
            raise ApiError(
                400,
                "The request body could not be read: it does not match its "
                f"Content-Encoding or Transfer-Encoding ({_cause(exc)}).",
                code="invalid_body_encoding",
                closes="now",
            ) from None
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)


def _check_coding(value: str) -> None:
    coding = value.strip().lower() if value.isascii() else value
    if coding not in DECODED_CODINGS | PLAIN_CODINGS:  # (the value is not echoed: it is the client's bytes)
        raise ApiError(
            400,
            "The request body could not be read: its Content-Encoding is not one this server decodes "
            f"(send one of {', '.join(sorted(DECODED_CODINGS))}, or none).",
            code="invalid_body_encoding",
            closes="after_body",
        )


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is too large: at most {max_bytes} bytes (after decompression).",
        code="body_too_large",
        closes="after_body",
    )


def decode_json(body: bytes, schema: type[T] | None = None) -> T | dict[str, Any]:
    """The body as a `schema` Struct (or a plain dict), or the OpenAI-shaped 400 for it."""
    if not body.strip():
        raise ApiError(400, "We could not parse the JSON body of your request: the body is empty.")
    field = too_deep_field(body)
    if field is not None:
        raise ApiError(
            400,
            depth_message(field)
            if field
            else f"The JSON body is nested too deeply: at most "
            f"{MAX_JSON_DEPTH} levels of objects and arrays are accepted.",
            field or None,
            "json_too_deep",
        )
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(
            400,
            f"We could not parse the JSON body of your request ({_why(exc, body)}). The API expects a JSON payload.",
        ) from None
    if not isinstance(value, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_type")
    if schema is None:
        return _without_nulls(value, None)
    try:
        return msgspec.convert(_without_nulls(value, schema), schema)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def _without_nulls(value: dict, schema: type | None) -> dict:
    """`value` without its null fields, and likewise inside fields that are Structs themselves."""
    nested = _struct_fields(schema) if schema is not None else {}
    out = {}
    for key, item in value.items():
        if item is None:
            continue
        if key in nested and isinstance(item, dict):
            item = _without_nulls(item, nested[key])
        out[key] = item
    return out


@cache
def _struct_fields(schema: type) -> dict[str, type]:
    """Field name -> Struct type, for the fields of `schema` whose type is (optionally) a Struct."""
    info = msgspec.inspect.type_info(schema)
    out = {}
    for field in info.fields:
        types = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for t in types:
            if isinstance(t, msgspec.inspect.StructType):
                out[field.encode_name] = t.cls
    return out


def _why(exc: msgspec.DecodeError, body: bytes) -> str:
    """msgspec's reason, except where it misleads: it says "truncated" of a lone UTF-16 surrogate escape
    ("\\ud800" without its pair), which Python's json (error path only) accepts."""
    if "truncated" in str(exc) and b"\\u" in body:
        try:
            json.loads(body)
        except ValueError:
            return str(exc)
        return "it contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is not text"
    return str(exc)


def _cause(exc: BaseException) -> str:
    """A short, safe description of why a payload failed (the exception class, never client bytes)."""
    cause = exc.__cause__ or exc
    return type(cause).__name__
