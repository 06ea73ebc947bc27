"""The built-in web app (a playground and a live dashboard) and the dashboard's data route.

The app is static files in api_proc/ui/, read once when a worker starts and served from memory: `/`
is index.html, every other file is `/ui/<its path under ui/>`. Each path is a route of its own, made
from the directory's listing, so nothing outside ui/ can be asked for however a path is spelled. The
pages use relative URLs only (`ui/app.js`, `v1/chat/completions`, `dashboard.json`), so they work
behind a reverse proxy that serves the server under a sub-path (`https://host/llm/` -> `/`).

The files hold no data and are the same for everyone, so they need no key (api_proc/auth.py lets
PAGE_PATHS through): the page has to load before it can ask for one. The data comes from the API's own
routes, with the key the page sends: /v1/* for the playground, and GET /dashboard.json, the dashboard's
numbers (detok_proc/dashboard.py), a user route.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from aiohttp import web

from pagoda.api_proc.client import AsyncEngineClient

UI_DIR = Path(__file__).resolve().parent / "ui"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE
}
# Only this server's own files may run or load; no framing (the admin button must not be clickjacked).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'self'; frame-ancestors 'none'"
)


def _page_files() -> dict[str, Path]:
    """URL path -> file, for every file of the app."""
    files = {"/": UI_DIR / "index.html"}
    for path in sorted(UI_DIR.rglob("*")):
        if path.is_file() and path.name != "index.html" and path.suffix in CONTENT_TYPES:
            files["/ui/" + path.relative_to(UI_DIR).as_posix()] = path
    return files


PAGE_PATHS = frozenset(_page_files())


def install_pages(app: web.Application) -> None:
    """GET / and GET /ui/...: the app's files, from memory, revalidated by ETag on each load (so an
    upgraded server is never shown with a stale script)."""
    for url_path, file in _page_files().items():
        app.router.add_get(url_path, _file_handler(file))


def _file_handler(file: Path):
    body = file.read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {
        "Content-Type": CONTENT_TYPES[file.suffix],
        "Cache-Control": "no-cache",
        "ETag": etag,
        "X-Content-Type-Options": "nosniff",
    }
    if file.suffix == ".html":
        headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        headers["Referrer-Policy"] = "no-referrer"

    async def serve(request: web.Request) -> web.Response:
        if etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        return web.Response(body=body, headers=headers)

    return serve


def install_dashboard_data(app: web.Application, client: AsyncEngineClient) -> None:
    """GET /dashboard.json (also with --no-ui: it is an API, the JSON side of /metrics)."""

    async def dashboard(request: web.Request) -> web.Response:
        body = await client.dashboard()
        return web.Response(body=body, headers={"Content-Type": "application/json", "Cache-Control": "no-store"})

    app.router.add_get("/dashboard.json", dashboard)
