"""What `pagoda router` is configured with (built once from its flags by api_proc/router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pagoda.api_proc.auth import AuthPolicy


@dataclass(frozen=True)
class RouterSettings:
    backends: tuple[str, ...]  # base URLs, as normalize_backend_url leaves them
    policy: str = "p2c"
    host: str = "127.0.0.1"
    port: int = 9000
    auth: AuthPolicy = field(default_factory=AuthPolicy)  # the router's own keys (clients -> router)
    backend_api_key: str | None = None  # sent to every backend (router -> backends)
    health_check_interval: float = 2.0  # seconds between two GET /health probes of a backend
    health_check_timeout: float = 2.0
    eject_after_failures: int = 3  # consecutive failed probes or requests that eject a backend
    load_poll_interval: float | None = 0.25  # GET /load of Pagoda backends; None = off
    connect_timeout: float = 5.0  # seconds to open a connection to a backend (then the next one is tried)
    read_timeout: float | None = 300.0  # seconds a backend may send nothing: before the first byte, or mid-body
    backend_keepalive_timeout: float = 15.0  # seconds an idle proxied connection to a backend stays open
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float | None = 30.0  # a client's request body: seconds without a byte (api_proc/request_body.py)
    header_timeout: float | None = 30.0  # a client's request head (api_proc/http_guard.py)
    keepalive_timeout: float = 75.0
    max_connections: int | None = 1024  # open client connections
    shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests get to finish
    seed: int | None = None  # of the random choices (p2c), for reproducible runs


def normalize_backend_url(url: str) -> str:
    """`http://host:port` of a backend given as `http://host:port` or `http://host:port/`; a URL that
    is not http(s), has no host, or names a path (a common slip: `.../v1`) is refused with why."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--backend {url!r}: expected a URL such as http://10.0.0.5:8000")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"--backend {url!r}: give the server's root URL, without a path such as /v1")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as exc:
        raise ValueError(f"--backend {url!r}: {exc}") from None
    return f"{parts.scheme}://{parts.netloc}"


def backend_urls(urls: list[str]) -> tuple[str, ...]:
    """The normalized URLs, each once; at least one."""
    if not urls:
        raise ValueError("give at least one --backend URL")
    normalized = [normalize_backend_url(u) for u in urls]
    repeated = sorted({u for u in normalized if normalized.count(u) > 1})
    if repeated:
        raise ValueError(f"--backend given twice for {', '.join(repeated)}")
    return tuple(normalized)
