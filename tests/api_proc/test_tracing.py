"""OpenTelemetry traces (`--otlp-traces-endpoint`) received by a small OTLP/HTTP receiver inside the test
(protobuf posts on /v1/traces, decoded with opentelemetry-proto): one trace per request, an incoming W3C
traceparent honoured, the HTTP worker's span the parent of the tokenizer process's spans (tokenize, and per
sample generate with queue / prefill / decode / detokenize under it), GenAI attributes equal to the
response's usage, and every child's time inside its parent's."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pagoda.api_proc.bench.local_server import MODEL_NAME, free_port, http, wait_until
from pagoda.detok_proc.tracing import traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
SLACK_NS = 2_000_000  # two clocks' readings of one moment (monotonic -> wall in two processes) may differ this much


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted, with its resource's attributes."""

    def __init__(self):
        self.spans: list[tuple[dict, Span]] = []
        self.paths: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.add(self.path)
                export = ExportTraceServiceRequest.FromString(body)
                for resource_spans in export.resource_spans:
                    resource = attributes_of(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans += [(resource, span) for span in scope_spans.spans]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[tuple[dict, Span]]:
        return [(r, s) for r, s in self.spans if s.trace_id.hex() == trace_id]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def attributes_of(key_values) -> dict:
    out = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def server(start_server, receiver):
    return start_server("--otlp-traces-endpoint", receiver.url)


def spans_of(receiver: Receiver, trace_id: str, expected: int) -> dict[str, list[tuple[dict, Span]]]:
    """The trace's spans by name, once `expected` of them have arrived."""
    assert wait_until(lambda: len(receiver.trace(trace_id)) >= expected, 30), receiver.trace(trace_id)
    by_name: dict[str, list[tuple[dict, Span]]] = {}
    for resource, span in receiver.trace(trace_id):
        by_name.setdefault(span.name, []).append((resource, span))
    return by_name


def inside(child: Span, parent: Span) -> bool:
    return (
        parent.start_time_unix_nano - SLACK_NS <= child.start_time_unix_nano
        and child.end_time_unix_nano <= parent.end_time_unix_nano + SLACK_NS
        and child.start_time_unix_nano <= child.end_time_unix_nano
    )


def test_the_endpoint_gets_otlps_path_when_it_has_none():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/custom/path") == "http://collector:4318/custom/path"
    with pytest.raises(ValueError):
        traces_url("collector:4318")


def test_a_chat_requests_trace_across_the_processes(server, receiver):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=8,
        temperature=0,
        n=2,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
    )
    # 1 HTTP span, tokenize, and per sample generate + queue, prefill, decode, detokenize
    spans = spans_of(receiver, TRACE_ID, 2 + 2 * 5)
    ((api_resource, api),) = spans[f"chat {MODEL_NAME}"]
    assert api.kind == Span.SPAN_KIND_SERVER and api.parent_span_id.hex() == PARENT_SPAN_ID
    assert api_resource["pagoda.process"] == "api" and api_resource["service.name"] == "pagoda"
    attributes = attributes_of(api.attributes)
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == MODEL_NAME
    assert attributes["gen_ai.response.model"] == MODEL_NAME
    assert attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert attributes["gen_ai.request.max_tokens"] == 8 and attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.response.id"] == reply.id and attributes["http.response.status_code"] == 200
    assert sorted(attributes["gen_ai.response.finish_reasons"]) == sorted({c.finish_reason for c in reply.choices})

    ((detok_resource, tokenize),) = spans["tokenize"]
    assert detok_resource["pagoda.process"] == "detok"
    assert tokenize.parent_span_id == api.span_id and inside(tokenize, api)
    assert attributes_of(tokenize.attributes)["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    generates = [span for _, span in spans["generate"]]
    assert len(generates) == 2 and all(g.parent_span_id == api.span_id and inside(g, api) for g in generates)
    samples = [attributes_of(g.attributes) for g in generates]
    assert sorted(s["pagoda.sample.index"] for s in samples) == [0, 1]
    assert sum(s["gen_ai.usage.output_tokens"] for s in samples) == reply.usage.completion_tokens
    for generate in generates:
        children = {
            span.name: span
            for name in ("queue", "prefill", "decode", "detokenize")
            for _, span in spans[name]
            if span.parent_span_id == generate.span_id
        }
        assert set(children) == {"queue", "prefill", "decode", "detokenize"}  # 8 tokens each: a decode phase
        assert all(inside(child, generate) for child in children.values())
        queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
        assert queue.start_time_unix_nano == generate.start_time_unix_nano  # handed to the engine
        assert queue.end_time_unix_nano == prefill.start_time_unix_nano  # first scheduled
        assert prefill.end_time_unix_nano == decode.start_time_unix_nano  # the first token's step
        # ... which ran (a forward pass takes time), and ended before its token reached the tokenizer process
        assert prefill.start_time_unix_nano < prefill.end_time_unix_nano
        assert prefill.end_time_unix_nano <= children["detokenize"].start_time_unix_nano + SLACK_NS
        assert attributes_of(children["detokenize"].attributes)["pagoda.detokenize.busy_s"] > 0
    assert receiver.paths == {"/v1/traces"}


def test_a_request_without_traceparent_starts_its_own_trace(server, receiver):
    before = {span.trace_id for _, span in receiver.spans}
    stream = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=1, temperature=0, stream=True
    )
    assert len([chunk for chunk in stream if chunk.choices]) == 1

    def new_api_span():
        return [s for _, s in receiver.spans if s.trace_id not in before and s.name.startswith("text_completion")]

    assert wait_until(new_api_span, 30)
    (api,) = new_api_span()
    assert api.parent_span_id == b""  # a root
    spans = spans_of(receiver, api.trace_id.hex(), 1 + 1 + 4)  # one output token: no decode phase
    assert set(spans) == {f"text_completion {MODEL_NAME}", "tokenize", "generate", "queue", "prefill", "detokenize"}
    assert attributes_of(spans["generate"][0][1].attributes)["gen_ai.usage.output_tokens"] == 1


def test_a_refused_request_is_one_span_with_its_status(server, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    status, _ = http(
        "POST",
        server.base_url + "/v1/completions",
        {"prompt": "x", "max_tokens": 0},
        headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )
    assert status == 400
    spans = spans_of(receiver, trace_id, 1)
    ((_, api),) = spans[f"text_completion {MODEL_NAME}"]  # (no "model" in the body: the served one)
    assert attributes_of(api.attributes)["http.response.status_code"] == 400 and len(receiver.trace(trace_id)) == 1


def test_a_bad_endpoint_is_refused_before_anything_starts(capsys, cli_main):
    assert cli_main(["serve", "--otlp-traces-endpoint", "collector:4318"]) == 2
    assert "--otlp-traces-endpoint must be an http(s):// URL" in capsys.readouterr().err
