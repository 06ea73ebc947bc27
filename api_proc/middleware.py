"""aiohttp middlewares around every route: CORS preflights (outermost, so they never need a key),
CORS headers on every response, and API-key checks (inside the OpenAI error envelope)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from pagoda.api_proc.auth import AuthPolicy
from pagoda.api_proc.openai_schema import ApiError


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ()  # "*" = any origin
    allowed_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")
    allow_credentials: bool = False
    max_age: int = 600

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.allowed_origins or origin in self.allowed_origins)


def install_cors(app: web.Application, cors: CorsSettings) -> None:
    """Answer preflights, and add the CORS headers to every response just before its headers go out
    (on_response_prepare: a streamed response has sent them before its handler returns)."""

    # Echo the origin rather than "*" when credentials are allowed: browsers refuse "*" then.
    wildcard = "*" in cors.allowed_origins and not cors.allow_credentials

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        if not cors.allowed_origins:
            return
        if not wildcard:  # the answer depends on Origin, for allowed and refused origins alike: caches
            vary = response.headers.get("Vary")  # must not give one origin's answer to another
            response.headers["Vary"] = "Origin" if not vary else vary if "origin" in vary.lower() else vary + ", Origin"
        origin = request.headers.get("Origin")
        if not cors.origin_allowed(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if wildcard else origin
        if cors.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"

    app.on_response_prepare.append(add_headers)


def preflight_middleware(cors: CorsSettings):
    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if not cors.origin_allowed(request.headers.get("Origin")):
            return web.Response(status=403, text="CORS origin not allowed")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": ", ".join(cors.allowed_methods),
                "Access-Control-Allow-Headers": ", ".join(cors.allowed_headers),
                "Access-Control-Max-Age": str(cors.max_age),
            },
        )

    return preflight


def auth_middleware(policy: AuthPolicy):
    @web.middleware
    async def check_key(request: web.Request, handler):
        refused = policy.check(request.path, request.headers.get("Authorization"))
        if refused is not None:
            status, message = refused
            code = "invalid_api_key" if status == 401 else "admin_key_required"
            raise ApiError(
                status, message, code=code, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None
            )
        return await handler(request)

    return check_key
