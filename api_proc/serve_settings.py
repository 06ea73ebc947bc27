"""`pagoda serve`: its flags, and the command that starts the launcher with them. How the flags become
the settings each process gets is api_proc/process_settings.py (HTTP workers: ApiSettings; the tokenizer
process: FrontendLimits) and engine_core/config.py (the engine: EngineConfig), which the launcher reads
without importing this module."""

from __future__ import annotations

import argparse
import math

from pagoda.detok_proc.routing import POLICIES as ROUTING_POLICIES
from pagoda.engine_core.config import add_engine_args


def _seconds_or_off(value: str) -> float | None:
    seconds = _seconds(value)
    return seconds or None


def _seconds(value: str) -> float:
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 or more), not {value!r}")
    return seconds


def _count(value: str) -> int:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, not {value!r}")
    return count


def _positive(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, not {value!r}")
    return count


def _count_or_off(value: str) -> int | None:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (no cap) or a positive number, not {value!r}")
    return count or None


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Access and limit flags of `pagoda serve`."""
    g = parser.add_argument_group("access")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; also PAGODA_API_KEY, "
        "comma-separated). With any key set, only the API's own routes are reachable",
    )
    g.add_argument("--api-key-file", default=None, help="file with one API key per line ('#' comments)")
    g.add_argument(
        "--admin-key",
        action="append",
        default=None,
        help="key for admin routes such as /reset_prefix_cache (repeatable; also PAGODA_ADMIN_KEY). "
        "With user keys but no admin key, admin routes are closed",
    )
    g.add_argument("--admin-key-file", default=None, help="file with one admin key per line")
    g.add_argument(
        "--protect-probes",
        action="store_true",
        help="/health, /load and /metrics need a key too (default: public, for load balancers and Prometheus)",
    )
    g.add_argument(
        "--allowed-origin",
        action="append",
        default=None,
        help="CORS: an origin browsers may call from ('*' = any; repeatable; default: no CORS headers)",
    )
    g.add_argument(
        "--allowed-header",
        action="append",
        default=None,
        help="CORS: request headers browsers may send (default: Authorization, Content-Type)",
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="include prompts and messages in the per-request log lines (off: users' data)",
    )
    add_log_format_args(g)
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces (one per request) over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (needs the otel extra: pip install 'pagoda-llm[otel]')",
    )
    g.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="/metrics is rendered at most once per this many seconds, off the request path; scrapes "
        "meanwhile get that text (0 = a fresh render for every scrape)",
    )
    g = parser.add_argument_group("limits")
    g.add_argument("--max-body-size", default="32MiB", help="largest request body (413 above)")
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt in tokens (400 above; default: the model's context length)",
    )
    g.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (400 above), also the default when a request "
        "sets none, or what the context leaves if less (default: no cap but the context length)",
    )
    g.add_argument("--max-n", type=int, default=128, help="largest n (samples per request)")
    g.add_argument(
        "--max-batch-inputs",
        type=int,
        default=2048,
        help="embedding models: most inputs in one /v1/embeddings or /pooling request (400 above; 0 = no limit)",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        default=65_536,
        help="embedding models: most tokens in one /v1/embeddings or /pooling request, its inputs together "
        "(400 above; 0 = no limit)",
    )
    g.add_argument(
        "--max-token-embed-values",
        type=int,
        default=4_194_304,
        help="embedding models: most values (tokens x dimensions) in one request's per-token output, "
        "/pooling's token_embed (400 above; 0 = no limit)",
    )
    g.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="running + queued requests (each sample counts); more get 429 with Retry-After",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take end to end before it is aborted (504; default: none)",
    )
    add_connection_args(g, "per API worker")


def add_connection_args(group, scope: str) -> None:
    """The client-connection limits `pagoda serve` and `pagoda router` share (enforced by
    api_proc/http_guard.py): `scope` says what the connection cap counts."""
    group.add_argument(
        "--header-timeout",
        type=_seconds_or_off,
        default=30.0,
        help="seconds a connection has to send a complete request head, from opening or from its "
        "first byte after a finished request (else 408 and closed; 0 = off)",
    )
    group.add_argument(
        "--body-timeout",
        type=_seconds_or_off,
        default=30.0,
        help="seconds a request body may go without a byte arriving; after that first grace it must also "
        "average 1 KiB/s (else 408 and closed; 0 = off)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=_seconds,
        default=75.0,
        help="seconds an idle keep-alive connection stays open (raise it above a load balancer's idle "
        "timeout, e.g. 620 behind Google Cloud's)",
    )
    group.add_argument(
        "--max-connections",
        type=_count_or_off,
        default=1024,
        help=f"open connections {scope}; at the cap the longest-idle connection is closed for a new one, "
        "or the new one gets 503 when all are busy (0 = no cap)",
    )


def add_log_format_args(group) -> None:
    """--log-format and --log-level, also accepted before the command (`pagoda --log-format json serve`):
    SUPPRESS keeps that value."""
    group.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=argparse.SUPPRESS,
        help="text lines, or one JSON object per line, from every process (default: text)",
    )
    group.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR (default: INFO)")


def add_serve_parser(subcommands) -> None:
    """`pagoda serve`: its flags (server, access, limits, logging, engine) and its handler."""
    srv = subcommands.add_parser("serve", help="run the OpenAI-compatible HTTP server (and the direct-client socket)")
    srv.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="Hugging Face model directory or hub id (same as --model; default: SmolLM2-135M-Instruct)",
    )
    srv.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (`max-num-seqs: 64`, lists for repeatable flags); the command line wins",
    )
    add_serve_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    g.add_argument("--port", type=int, default=8000, help="port the HTTP API listens on")
    g.add_argument("--api-workers", type=int, default=1, help="HTTP worker processes sharing the port (SO_REUSEPORT)")
    g.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="name(s) clients use in 'model' (repeatable; default: the model argument)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM/SIGINT waits for in-flight requests before ending them",
    )
    g.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=30.0,
        help="/health turns 503 when the engine loop has made no progress for this long",
    )
    g.add_argument(
        "--frontend",
        default=None,
        help="extra address for direct clients: ipc:///path.sock, or tcp://host:port (needs --curve-keys)",
    )
    g.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="CURVE certificates for a tcp:// frontend, as written by `pagoda keys DIR`",
    )
    g.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the web app (playground and dashboard) at /; GET /dashboard.json stays",
    )
    add_data_parallel_args(parser)
    add_ray_args(parser)
    add_limit_args(parser)


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive,
        default=1,
        help="engine replicas, each with its own KV cache and scheduler, behind the one endpoint",
    )
    g.add_argument(
        "--dp-routing",
        choices=ROUTING_POLICIES,
        default="p2c",
        help="how a request picks its replica: p2c = the less loaded of two random ones, or where its "
        "prefix went before; round_robin = in turn",
    )
    g.add_argument(
        "--max-replica-restarts",
        type=_count,
        default=3,
        help="times a replica that died is restarted (backoff 1, 2, 4... s) before it stays down; with one "
        "engine the server exits instead",
    )


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray (docs/ray.md)")
    g.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray"),
        default="mp",
        help="how engine replicas are started: mp = processes of this machine; ray = Ray actors placed on a "
        "Ray cluster (needs the ray extra: pip install 'pagoda-llm[ray]')",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (e.g. 10.0.0.1:6379, as `ray start --head` printed); default: start a "
        "local one that lives as long as the server",
    )
    g.add_argument(
        "--ray-cpus-per-rank",
        type=_positive,
        default=1,
        help="CPUs each engine rank reserves in its replica's placement group (and its torch threads)",
    )
    g.add_argument(
        "--ray-placement-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="start-up fails when a replica's placement group cannot be placed within this, naming the "
        "resources asked for and those available",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.api_proc.launcher import serve  # the launcher starts processes: only `pagoda serve` needs it

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ValueError("give the model once: as the MODEL argument or as --model")
        args.model = args.model_arg
    if args.api_workers < 1:
        raise ValueError("--api-workers must be at least 1")
    if args.otlp_traces_endpoint:  # refused now, not in every child: a bad URL, or the extra not installed
        from pagoda.detok_proc.tracing import check_available, traces_url

        traces_url(args.otlp_traces_endpoint)
        check_available()
    return serve(args)
