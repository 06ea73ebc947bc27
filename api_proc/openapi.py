"""GET /openapi.json: an OpenAPI 3.1 document of every route, generated at start-up.

The body schemas come from the msgspec types themselves (msgspec.json.schema_components over the request
types in api_proc/openai_schema.py and the response types in api_proc/openai_responses.py); nothing
here describes a body by hand. What is written here is the route table: each route's method, path,
summary, request type and response types. The document is checked against the application's router
when it is made, so a route added without an entry here stops the server from starting (and every test
with it), rather than going undocumented.

Auth follows api_proc/auth.py: routes in USER_ROUTES and ADMIN_ROUTES declare bearer auth (an admin key
for the latter), probes and the web app's files none (probes too with --protect-probes). With no keys
configured nothing asks for one.

Request bodies: a JSON null is read as absent (api_proc/request_body.py), so every optional property of a
request type accepts null besides its own type; the generated schemas are widened accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

import msgspec
from aiohttp import web

from pagoda.api_proc import openai_responses as out
from pagoda.api_proc.auth import ADMIN_ROUTES, PROBE_ROUTES, USER_ROUTES, AuthPolicy
from pagoda.api_proc.embeddings import EmbeddingRequest, PoolingRequest
from pagoda.api_proc.openai_schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagoda.api_proc.web_ui import CONTENT_TYPES, PAGE_PATHS
from pagoda.engine_core.identity import PAGODA_VERSION

REF = "#/components/schemas/{name}"
JSON, EVENTS, TEXT = "application/json", "text/event-stream", "text/plain"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    body: type | None = None  # the request type (JSON)
    answer: type | None = None  # the 200 JSON type
    media: str = JSON  # the 200 media type when not JSON (text, pages)
    stream: type | None = None  # the event type when "stream": true (text/event-stream)


ROUTES = [
    Route("GET", "/health", "Liveness and readiness (200 serving, 503 otherwise; the body says why)", None, out.Health),
    Route("GET", "/load", "Running and waiting requests and KV-cache usage (what pagoda router reads)", None, out.Load),
    Route("GET", "/version", "The server's version", None, out.Version),
    Route("GET", "/v1/models", "The served model (under each --served-model-name)", None, out.ModelList),
    Route(
        "POST",
        "/v1/completions",
        "OpenAI's completions (vLLM's extra parameters too)",
        CompletionRequest,
        out.Completion,
        stream=out.Completion,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        "OpenAI's chat completions (tools, structured output, vLLM's extra parameters)",
        ChatCompletionRequest,
        out.ChatCompletion,
        stream=out.ChatCompletionChunk,
    ),
    Route(
        "POST",
        "/tokenize",
        "A prompt's tokens (a text, or chat messages as a chat completion renders them)",
        TokenizeRequest,
        out.Tokenized,
    ),
    Route("POST", "/detokenize", "Token ids back to text", DetokenizeRequest, out.Detokenized),
    Route("POST", "/v1/embeddings", "OpenAI's embeddings (an embedding model)", EmbeddingRequest, out.EmbeddingList),
    Route("POST", "/pooling", "vLLM's pooling: pooled or per-token vectors", PoolingRequest, out.PoolingList),
    Route("POST", "/reset_prefix_cache", "Forget every cached prefix (admin key)", None, out.PrefixCacheReset),
    Route("GET", "/metrics", "Prometheus metrics, vLLM's names (docs/observability.md)", media=TEXT),
    Route("GET", "/dashboard.json", "The web dashboard's numbers", None, out.Dashboard),
    Route("GET", "/openapi.json", "This document", media=JSON),
]
REQUEST_TYPES = [route.body for route in ROUTES if route.body is not None]


def page_routes() -> list[Route]:
    """The web app's files (api_proc/web_ui.py), one route each."""
    return [
        Route("GET", path, "The web app" if path == "/" else "A file of the web app", media=_page_media(path))
        for path in sorted(PAGE_PATHS)
    ]


def _page_media(path: str) -> str:
    suffix = ".html" if path == "/" else PurePosixPath(path).suffix
    return CONTENT_TYPES[suffix].split(";")[0]


def document(app: web.Application, auth: AuthPolicy, with_pages: bool) -> dict:
    """The OpenAPI document of `app`'s routes (ValueError if the table misses one, or has one too many)."""
    routes = ROUTES + (page_routes() if with_pages else [])
    _check_covers(app, routes)
    types = [t for route in routes for t in (route.body, route.answer, route.stream) if t is not None]
    _, components = msgspec.json.schema_components([*types, out.ErrorResponse], ref_template=REF)
    for request_type in REQUEST_TYPES:
        _accept_nulls(components, request_type.__name__)
    paths: dict[str, dict] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, auth)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Pagoda",
            "version": PAGODA_VERSION,
            "description": "OpenAI-compatible LLM server. Errors are OpenAI's envelope "
            '({"error": {"message", "type", "param", "code"}}). Routes that declare bearer auth need a key '
            "only when the server has keys (--api-key / --admin-key).",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operation(route: Route, auth: AuthPolicy) -> dict:
    error = {"description": "An error, in OpenAI's shape", "content": {JSON: {"schema": _ref(out.ErrorResponse)}}}
    if route.answer is not None:
        content = {JSON: {"schema": _ref(route.answer)}}
    else:
        content = {route.media: {"schema": {"type": "string"} if route.media != JSON else {"type": "object"}}}
    if route.stream is not None:
        content[EVENTS] = {"schema": _event(route.stream)}
    operation: dict = {
        "summary": route.summary,
        "operationId": route.method.lower() + route.path.replace("/", "_").replace(".", "_"),
        "responses": {"200": {"description": "OK", "content": content}, "default": error},
        "security": _security(route.path, auth),
    }
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(route.body)}}}
    return operation


def _event(chunk: type) -> dict:
    """One server-sent event of a stream (OpenAPI before 3.2: `schema` describes each event): its `data`
    is a `chunk` in JSON, or an error in OpenAI's shape (met after the 200 went out), or the final [DONE]."""
    payload = {"anyOf": [_ref(chunk), _ref(out.ErrorResponse)]}
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": JSON, "contentSchema": payload}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _security(path: str, auth: AuthPolicy) -> list[dict]:
    if path in USER_ROUTES or path in ADMIN_ROUTES or (path in PROBE_ROUTES and auth.protect_probes):
        return [{"bearerAuth": []}]
    return []


def _ref(type_: type) -> dict:
    return {"$ref": REF.format(name=type_.__name__)}


def _accept_nulls(components: dict, name: str) -> None:
    """Every optional property of a request type (and of the request types inside it) may also be null
    (a required one may not: null is read as absent)."""
    required = set(components[name].get("required", []))
    for prop_name, prop in list(components[name].get("properties", {}).items()):
        options = prop.get("anyOf", [prop])
        if prop_name not in required and not any(option.get("type") == "null" for option in options):
            default = {"default": prop["default"]} if "default" in prop else {}
            bare = {k: v for k, v in prop.items() if k != "default"}
            components[name]["properties"][prop_name] = {"anyOf": [bare, {"type": "null"}], **default}
        for option in options:
            ref = option.get("$ref")
            if ref:
                _accept_nulls(components, ref.rsplit("/", 1)[-1])


def _check_covers(app: web.Application, routes: list[Route]) -> None:
    documented = {(route.method, route.path) for route in routes}
    served = {
        (resource_route.method, resource.canonical)
        for resource in app.router.resources()
        for resource_route in resource
        if resource_route.method != "HEAD"  # (aiohttp adds HEAD beside every GET)
    }
    if documented != served:
        raise ValueError(
            f"/openapi.json and the routes differ: undocumented {sorted(served - documented)}, "
            f"documented but not served {sorted(documented - served)} (api_proc/openapi.py ROUTES)"
        )


def install(app: web.Application, auth: AuthPolicy, with_pages: bool) -> None:
    """GET /openapi.json; the document is made (and checked) once the app's routes are all added."""
    body: list[bytes] = []

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body[0], content_type=JSON)

    async def make(app: web.Application) -> None:
        body.append(msgspec.json.encode(document(app, auth, with_pages)))

    app.router.add_get("/openapi.json", openapi)
    app.on_startup.append(make)
