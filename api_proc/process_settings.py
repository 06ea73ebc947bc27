"""The settings each process of `pagoda serve` gets, made from its parsed flags (api_proc/serve_settings.py):
HTTP workers get ApiSettings, the tokenizer process FrontendLimits. The launcher builds them when it starts
the processes; the flags themselves are declared in serve_settings.py, which starts the launcher."""

from __future__ import annotations

import argparse

from pagoda.api_proc.auth import AuthPolicy, read_keys
from pagoda.api_proc.middleware import CorsSettings
from pagoda.api_proc.server import ApiSettings
from pagoda.detok_proc.limits import FrontendLimits
from pagoda.engine_core.config import parse_size
from pagoda.engine_core.structured_limits import StructuredOutputLimits


def auth_policy(args: argparse.Namespace) -> AuthPolicy:
    return AuthPolicy(
        api_keys=tuple(read_keys(args.api_key, "PAGODA_API_KEY", args.api_key_file)),
        admin_keys=tuple(read_keys(args.admin_key, "PAGODA_ADMIN_KEY", args.admin_key_file)),
        protect_probes=args.protect_probes,
    )


def api_settings(args: argparse.Namespace, frontend_addr: str, served_model_names: list[str]) -> ApiSettings:
    cors = None
    if args.allowed_origin:
        cors = CorsSettings(
            allowed_origins=tuple(args.allowed_origin),
            allowed_headers=tuple(args.allowed_header or CorsSettings.allowed_headers),
            allow_credentials=args.allow_credentials,
        )
    return ApiSettings(
        frontend_addr=frontend_addr,
        served_model_names=served_model_names,
        host=args.host,
        port=args.port,
        reuse_port=args.api_workers > 1,
        shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=parse_size(args.max_body_size),
        auth=auth_policy(args),
        cors=cors,
        max_n=args.max_n,
        request_timeout=args.request_timeout,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections,
        max_tokens_cap=args.max_tokens_cap,
        log_requests=args.log_requests,
        ui=not args.no_ui,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        structured_limits=StructuredOutputLimits(
            args.structured_output_max_bytes, args.structured_output_max_properties, args.structured_output_max_choices
        ),
    )


def frontend_limits(args: argparse.Namespace) -> FrontendLimits:
    return FrontendLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_pending_requests=args.max_pending_requests,
        max_tokens_cap=args.max_tokens_cap,
        max_batch_inputs=args.max_batch_inputs or None,
        max_batch_tokens=args.max_batch_tokens or None,
        max_token_embed_values=args.max_token_embed_values or None,
    )
