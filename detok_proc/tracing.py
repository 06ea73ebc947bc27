"""OpenTelemetry traces (`pagoda serve --otlp-traces-endpoint URL`), exported over OTLP/HTTP.

One trace per request. The HTTP worker opens the request's span (api_proc/request_trace.py), honouring
an incoming W3C `traceparent`, and hands its context to this process in `GenerateRequest.trace_context`
(a traceparent string). This process adds, under that span:

    tokenize      the request's arrival here -> its prompt's tokens handed to the engine
    generate      per sample (one per `n`): handed to the engine -> its last token, with children
      queue       the engine's queue time (arrival in the engine -> first scheduled; the engine's measure)
      prefill     first scheduled -> the engine step that produced the first token (that step's time)
      decode      the first token's step -> the last token's step (absent with one output token)
      detokenize  first -> last delta turned into text here; pagoda.detokenize.busy_s: the time spent on it

The engine's busy loop never talks to an exporter: it records what it already sends, the queue time in
a request's first RequestDelta and each step's wall-clock time in StepOutputs.timestamp, and this
process turns them into spans. Attributes follow OpenTelemetry's GenAI semantic conventions
(gen_ai.request.model, gen_ai.usage.input_tokens / output_tokens, gen_ai.response.finish_reasons, ...).
Spans leave through the SDK's batch processor on its own thread: the loop only queues them.

The SDK and exporter are the optional extra `pagoda-llm[otel]`; without them the flag is refused at start.
"""

from __future__ import annotations

import time
from typing import Any

from pagoda.detok_proc.sample import SampleState, SampleTrace
from pagoda.engine_core import protocol

TRACES_PATH = "/v1/traces"
EXPORT_TIMEOUT_S = 5.0  # one export's limit: an unreachable collector never holds a process up longer
MISSING = (
    "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP/HTTP exporter: pip install 'pagoda-llm[otel]' "
    "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given, or with OTLP's /v1/traces when it has no path
    (http://collector:4318 -> http://collector:4318/v1/traces, as OTEL_EXPORTER_OTLP_ENDPOINT)."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s):// URL, not {endpoint!r}")
    return endpoint.rstrip("/") + TRACES_PATH if parts.path in ("", "/") else endpoint


def check_available() -> None:
    """ValueError (with what to install) unless the SDK and the exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"{MISSING} ({exc})") from None


def wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading of this process as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class Tracer:
    """This process's tracer: spans with explicit times, parents from traceparent strings."""

    def __init__(self, endpoint: str, process: str):
        check_available()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": "pagoda", "pagoda.process": process})
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("pagoda")
        self.propagator = TraceContextTextMapPropagator()

    def context(self, traceparent: str | None):
        """The parent context a traceparent names (None or malformed: a new trace)."""
        return self.propagator.extract({"traceparent": traceparent} if traceparent else {})

    def traceparent(self, span) -> str:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier["traceparent"]

    def span(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict[str, Any]):
        """A finished span from `start_ns` to `end_ns` (wall clock), child of `parent` (a context or span)."""
        from opentelemetry import trace

        context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        span = self.tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def shutdown(self) -> None:
        """Export what is queued (each export bounded by EXPORT_TIMEOUT_S), then stop."""
        self.provider.shutdown()


class RequestTracing:
    """The tokenizer process's side: a request's tokenize span, and each sample's spans when it ends."""

    def __init__(self, endpoint: str, model: str):
        self.tracer = Tracer(endpoint, "detok")
        self.model = model

    def admitted(self, request: protocol.GenerateRequest, arrival: float, num_prompt_tokens: int) -> SampleTrace:
        """The request's tokens go to the engine now: its tokenize span; the samples' trace state."""
        parent = self.tracer.context(request.trace_context)
        attributes = {"gen_ai.request.model": self.model, "gen_ai.usage.input_tokens": num_prompt_tokens}
        self.tracer.span("tokenize", parent, wall_ns(arrival), time.time_ns(), attributes)
        return SampleTrace(parent, self.model)

    @staticmethod
    def tokens(trace: SampleTrace, delta: protocol.RequestDelta, step_time: float, busy: float) -> None:
        """A delta of the sample arrived from the step that ended at `step_time` (engine wall clock)."""
        trace.busy += busy
        trace.cached_tokens = max(trace.cached_tokens, delta.num_cached_tokens)
        if delta.new_token_ids:
            if trace.first_step is None:
                trace.first_step = step_time
            trace.last_step = step_time

    def finished(self, sample: SampleState, finish_reason: protocol.FinishReason) -> None:
        """The sample ended (or its client aborted it): its generate span and the phases under it."""
        trace, timing = sample.trace, sample.timing
        if trace is None:
            return
        end = time.time_ns()
        admitted = wall_ns(timing.admitted)
        attributes = {
            "gen_ai.request.model": trace.model,
            "gen_ai.response.model": trace.model,
            "gen_ai.response.finish_reasons": [finish_reason.value],
            "gen_ai.usage.input_tokens": sample.num_prompt_tokens,
            "gen_ai.usage.output_tokens": sample.num_output_tokens,
            "pagoda.sample.index": sample.index,
            "pagoda.engine": sample.engine,
            "pagoda.cached_tokens": trace.cached_tokens,
        }
        if timing.queue_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = timing.queue_time
        generate = self.tracer.span("generate", trace.parent, admitted, end, attributes)
        if timing.queue_time is None or trace.first_step is None:  # ended (aborted) before its first token
            return
        queued_until = admitted + int(timing.queue_time * 1e9)
        first, last = int(trace.first_step * 1e9), int((trace.last_step or trace.first_step) * 1e9)
        first = max(first, queued_until)  # (an engine on another machine: its clock, bounded by ours)
        self.tracer.span("queue", generate, admitted, queued_until, {})
        self.tracer.span(
            "prefill", generate, queued_until, first, {"gen_ai.usage.input_tokens": sample.num_prompt_tokens}
        )
        if sample.num_output_tokens > 1:
            self.tracer.span(
                "decode", generate, first, max(last, first), {"gen_ai.usage.output_tokens": sample.num_output_tokens}
            )
        if timing.first_token is not None:
            self.tracer.span(
                "detokenize", generate, wall_ns(timing.first_token), end, {"pagoda.detokenize.busy_s": trace.busy}
            )

    def shutdown(self) -> None:
        self.tracer.shutdown()
