"""API keys: which requests may reach which routes.

Deny by default. Once any key is configured, a route is reachable only if it is on an allow-list:
`USER_ROUTES` take a user key (or an admin key), `ADMIN_ROUTES` only an admin key, `PROBE_ROUTES`
(`/health`, `/load`, `/metrics`) are public unless `protect_probes`: load balancers and Prometheus read
them without a user's key, and `/load` (running and waiting requests, KV-cache usage, polled by
`pagoda router`) tells no more than the gauges of `/metrics`. The web app's static files (`PAGE_PATHS`,
api_proc/web_ui.py: no data, and the page must load to ask for a key) are public too. Every other path —
including ones added later and never listed, and paths that would 404 — answers 401 to a caller without
a key, so no route slips through because of how its path is spelled (a prefix check such as "starts with
/v1" lets `/v1/../admin` style paths and later routes past). With no keys at all, everything is open (a
local development server), except that admin routes then still need the admin key when one is set.

Keys come from `--api-key` (repeatable), `PAGODA_API_KEY` (comma-separated) and `--api-key-file`
(one per line, `#` comments); admin keys likewise from `--admin-key`, `PAGODA_ADMIN_KEY` and
`--admin-key-file`. Comparison is constant-time (hmac.compare_digest against every key, no early
exit), so response timing does not reveal how much of a key was right.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.api_proc.web_ui import PAGE_PATHS
from pagoda.engine_core.environment import keys_from_environment

USER_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/pooling",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/dashboard.json",
        "/openapi.json",
    }
)
ADMIN_ROUTES = frozenset({"/reset_prefix_cache"})
PROBE_ROUTES = frozenset({"/health", "/load", "/metrics"})


def read_keys(flag_values: list[str] | None, env_var: str, key_file: str | None) -> list[str]:
    """Every key from a repeatable flag, a comma-separated environment variable and a key file."""
    keys = list(flag_values or [])
    keys += keys_from_environment(env_var)
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            if not line.lstrip().startswith("#"):  # whole-line comments only: a key may contain '#'
                keys.append(line)
    keys = [k.strip() for k in keys if k.strip()]
    if any(len(k) < 8 for k in keys):
        raise ValueError("API keys must be at least 8 characters long")
    return keys


@dataclass(frozen=True)
class AuthPolicy:
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    protect_probes: bool = False  # /health and /metrics need a key too
    _encoded: tuple[tuple[bytes, ...], tuple[bytes, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self, "_encoded", (tuple(k.encode() for k in self.api_keys), tuple(k.encode() for k in self.admin_keys))
        )

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    def check(self, path: str, authorization: str | None) -> tuple[int, str] | None:
        """None if the request may proceed, else (401 or 403, message)."""
        if not self.enabled or path in PAGE_PATHS:
            return None
        token = _bearer(authorization)
        is_user = _matches(token, self._encoded[0])
        is_admin = _matches(token, self._encoded[1])
        if path in ADMIN_ROUTES:
            if is_admin:
                return None
            if is_user:
                return 403, "This route needs the admin key."
            return 401, _missing_or_wrong(token)
        if path in PROBE_ROUTES and not self.protect_probes:
            return None
        if not self.api_keys and path in USER_ROUTES:  # only an admin key is set: user routes stay open
            return None
        if is_user or is_admin:  # a valid key on an unknown path: routing answers 404/405
            return None
        return 401, _missing_or_wrong(token)


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes header bytes with surrogateescape: encode them back the same way, never raise.
    return token.strip().encode("utf-8", "surrogateescape")


def _matches(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    if token is None:
        return False
    found = False
    for key in keys:  # no early exit: every key is compared, each in constant time
        found |= hmac.compare_digest(token, key)
    return found


def _missing_or_wrong(token: bytes | None) -> str:
    if token is None:
        return (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    return "Incorrect API key provided."
