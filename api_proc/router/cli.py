"""`pagoda router`: its flags, and the RouterSettings they make."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pagoda.api_proc.auth import AuthPolicy, read_keys
from pagoda.api_proc.router.policies import POLICIES
from pagoda.api_proc.router.settings import RouterSettings, backend_urls
from pagoda.api_proc.serve_settings import (
    _positive,
    _seconds,
    _seconds_or_off,
    add_connection_args,
    add_log_format_args,
)
from pagoda.engine_core.config import parse_size


def _interval(value: str) -> float:
    seconds = _seconds(value)
    if seconds == 0:
        raise argparse.ArgumentTypeError("expected a number of seconds above 0")
    return seconds


def add_router_parser(subcommands) -> None:
    router = subcommands.add_parser(
        "router", help="spread OpenAI API requests over several servers (power of two choices, health checks)"
    )
    router.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (`backend: [http://h1:8000, http://h2:8000]`); the command line wins",
    )
    g = router.add_argument_group("backends")
    g.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible server's root URL, e.g. http://10.0.0.5:8000 (repeatable; at least one)",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="p2c",
        help="p2c = the less loaded of two random backends; round_robin = in turn; prefix = where the "
        "prompt's first ~1,024 characters hash to (rendezvous), p2c when that backend is overloaded",
    )
    g.add_argument("--backend-api-key", default=None, help="key sent to every backend as 'Authorization: Bearer KEY'")
    g.add_argument("--backend-api-key-file", default=None, help="file holding --backend-api-key (its first line)")
    g.add_argument("--seed", type=int, default=None, help="seed of p2c's random choices (default: random)")
    g = router.add_argument_group("health checks")
    g.add_argument(
        "--health-check-interval",
        type=_interval,
        default=2.0,
        help="seconds between two GET /health probes of each backend, ejected ones included",
    )
    g.add_argument(
        "--health-check-timeout", type=_interval, default=2.0, help="seconds a probe (and a GET /load poll) may take"
    )
    g.add_argument(
        "--eject-after-failures",
        type=_positive,
        default=3,
        help="consecutive failures (probes, or requests that got no connection or no answer) that take "
        "a backend out of rotation; one passing probe brings it back",
    )
    g.add_argument(
        "--load-poll-interval",
        type=_seconds,
        default=0.25,
        help="seconds between two GET /load polls of each Pagoda backend (0 = off: in-flight counts only)",
    )
    g = router.add_argument_group("timeouts")
    g.add_argument(
        "--connect-timeout",
        type=_interval,
        default=5.0,
        help="seconds to open a connection to a backend; then the next backend is tried",
    )
    g.add_argument(
        "--read-timeout",
        type=_seconds_or_off,
        default=300.0,
        help="seconds a backend may send nothing, before its first byte (the whole generation, for a "
        "request that does not stream) or between two chunks; then 504, or an error event (0 = off)",
    )
    g.add_argument(
        "--backend-keepalive-timeout",
        type=_interval,
        default=15.0,
        help="seconds an idle connection to a backend stays open for the next request (keep it below "
        "the backends' --keepalive-timeout, 75 by default)",
    )
    g = router.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    g.add_argument("--port", type=int, default=9000, help="port the router listens on")
    g.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="seconds SIGTERM/SIGINT waits for in-flight requests before closing them",
    )
    g = router.add_argument_group("access and limits")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key clients must send the router as 'Authorization: Bearer KEY' (repeatable)",
    )
    g.add_argument("--api-key-file", default=None, help="file with one API key per line ('#' comments)")
    g.add_argument("--protect-probes", action="store_true", help="the router's /health and /metrics need a key too")
    g.add_argument("--max-body-size", default="32MiB", help="largest request body (413 above)")
    add_connection_args(g, "from clients")
    add_log_format_args(router.add_argument_group("logging"))
    router.set_defaults(func=cmd_router)


def _backend_key(args: argparse.Namespace) -> str | None:
    if args.backend_api_key and args.backend_api_key_file:
        raise ValueError("give --backend-api-key or --backend-api-key-file, not both")
    if not args.backend_api_key_file:
        return args.backend_api_key
    with open(args.backend_api_key_file, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"--backend-api-key-file {args.backend_api_key_file}: no key in it")
    return lines[0]


def router_settings(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        backends=backend_urls(args.backend or []),
        policy=args.policy,
        host=args.host,
        port=args.port,
        auth=AuthPolicy(
            api_keys=tuple(read_keys(args.api_key, "PAGODA_ROUTER_API_KEY", args.api_key_file)),
            protect_probes=args.protect_probes,
        ),
        backend_api_key=_backend_key(args),
        health_check_interval=args.health_check_interval,
        health_check_timeout=args.health_check_timeout,
        eject_after_failures=args.eject_after_failures,
        load_poll_interval=args.load_poll_interval or None,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        backend_keepalive_timeout=args.backend_keepalive_timeout,
        max_body_bytes=parse_size(args.max_body_size),
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout,
        seed=args.seed,
    )


def cmd_router(args: argparse.Namespace) -> int:
    from pagoda.api_proc.router.service import run_router  # aiohttp's client and server: only this command needs them

    settings = router_settings(args)
    try:
        return asyncio.run(run_router(settings))
    except OSError as exc:
        print(f"pagoda router: error: {exc}", file=sys.stderr)
        return 1
