"""The HTTP worker's span of a traced generation request (`--otlp-traces-endpoint`; detok_proc/tracing.py
has the rest of the trace and how it fits together).

`with HttpTracing.traced(tracing, request, record):` wraps a generation handler outside `logged(record)`,
so that when the span ends the record knows how the request ended (status, token counts, finish
reasons). The span continues an incoming W3C `traceparent` (else it starts a trace); its own traceparent
goes to the tokenizer process in GenerateRequest.trace_context (`record.trace_context`). Named and
attributed after OpenTelemetry's GenAI conventions: "chat MODEL" / "text_completion MODEL", kind SERVER.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

from aiohttp import web

from pagoda.api_proc.request_log import RequestRecord
from pagoda.detok_proc.tracing import Tracer

OPERATIONS = {"chat": "chat", "completions": "text_completion"}  # RequestRecord.endpoint -> gen_ai.operation.name


class HttpTracing:
    def __init__(self, endpoint: str, served_model: str):
        self.tracer = Tracer(endpoint, "api")
        self.served_model = served_model  # the model a request without "model" gets

    async def on_cleanup(self, app: web.Application) -> None:
        """The worker is stopping: export what is queued (bounded by the exporter's timeout)."""
        await asyncio.to_thread(self.tracer.shutdown)

    @staticmethod
    @contextmanager
    def traced(tracing: HttpTracing | None, request: web.Request, record: RequestRecord):
        """The request's span around the block (nothing without tracing)."""
        if tracing is None:
            yield
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        tracer = tracing.tracer
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k)) is not None}
        operation = OPERATIONS[record.endpoint]
        span = tracer.tracer.start_span(
            f"{request.method} {request.path}",
            context=tracer.propagator.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        )
        record.trace_context = tracer.traceparent(span)
        try:
            yield
        finally:
            span.set_attributes(_attributes(operation, record))
            span.set_attribute("gen_ai.response.model", tracing.served_model)
            if record.request is not None:  # parsed: it is a request for a model
                span.update_name(f"{operation} {getattr(record.request, 'model', None) or tracing.served_model}")
            if record.status is not None and record.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(record.status))
            span.end()


def _attributes(operation: str, record: RequestRecord) -> dict:
    """GenAI (and HTTP) attributes of a finished request."""
    attributes: dict = {
        "gen_ai.operation.name": operation,
        "gen_ai.response.id": record.request_id,
        "gen_ai.usage.input_tokens": sum(record.prompt_tokens.values()),
        "gen_ai.usage.output_tokens": sum(record.output_tokens.values()),
        "gen_ai.response.finish_reasons": sorted(reason.value for reason in record.finish_reasons),
    }
    if record.status is not None:
        attributes["http.response.status_code"] = record.status
    if record.first_token is not None:
        attributes["pagoda.time_to_first_token_s"] = record.first_token - record.started
    body = record.request
    if body is not None:
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        requested = {
            "gen_ai.request.model": body.model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.seed": body.seed,
            "gen_ai.request.choice.count": body.n,
        }
        attributes.update({k: v for k, v in requested.items() if v is not None})
    return attributes
