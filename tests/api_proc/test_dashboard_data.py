"""GET /dashboard.json of a real `pagoda serve --no-ui`: the web app is off, its data route is not; its
numbers are /metrics' numbers; its timeline records each request as the API answered it (a running
one included, an aborted one marked); its rates show the tokens generated. Route access under keys
is checked on the policy itself (the browser test runs the keyed server)."""

from __future__ import annotations

import pytest

from pagoda.api_proc.auth import AuthPolicy
from pagoda.api_proc.bench.local_server import MODEL_NAME, http, wait_until
from pagoda.api_proc.web_ui import PAGE_PATHS
from tests.metrics_scrape import Scrape

PROMPTS = ["Name a colour.", "What is two plus two?", "Say hello in French."]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--no-ui")


def dashboard(server) -> dict:
    status, body = http("GET", server.base_url + "/dashboard.json")
    assert status == 200, body
    return body


def test_no_ui_turns_the_pages_off_but_not_the_data(server):
    for path in ("/", "/ui/app.js", "/ui/vendor/uplot/uPlot.iife.min.js"):
        assert http("GET", server.base_url + path)[0] == 404, path
    report = dashboard(server)
    assert report["model"] == MODEL_NAME and [e["engine"] for e in report["engines"]] == [0]
    assert set(report["latency"]) == {"window_seconds", "ttft", "itl", "e2e"}


def test_the_numbers_match_metrics_and_the_timeline_records_each_request(server, client):
    replies = [
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": p}], max_tokens=12, temperature=0
        )
        for p in PROMPTS
    ]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=500,
        temperature=0,
        stream=True,
    )
    next(iter(stream))  # its first token is out: it runs now

    def running(report: dict) -> dict | None:
        last = report["timeline"][-1]
        return last if last["end"] is None and last["first_token"] is not None else None

    live = running(dashboard(server))
    assert live is not None and live["finish_reason"] is None and live["output_tokens"] >= 1
    assert live["arrival"] <= live["admitted"] <= live["scheduled"] <= live["first_token"] <= 0
    stream.close()  # the client goes away: the request is aborted
    assert wait_until(lambda: dashboard(server)["timeline"][-1]["finish_reason"] == "abort", 30)

    # Idle now: the numbers are exactly /metrics'.
    assert wait_until(lambda: Scrape(server).value("vllm:num_requests_running") == 0, 30)
    report, metrics = dashboard(server), Scrape(server)
    for name, value in report["engines"][0]["metrics"].items():
        assert value == metrics.value(name, engine="0"), name
    for name, value in report["server"].items():
        assert value == metrics.value(name), name

    timeline = report["timeline"]
    for entry, reply in zip(timeline[-4:-1], replies, strict=True):
        assert entry["prompt_tokens"] == reply.usage.prompt_tokens
        assert entry["output_tokens"] == reply.usage.completion_tokens
        assert entry["finish_reason"] == reply.choices[0].finish_reason
        assert entry["arrival"] <= entry["admitted"] <= entry["scheduled"] <= entry["first_token"] <= entry["end"] <= 0
    latency = report["latency"]
    assert latency["ttft"]["count"] <= metrics.value("vllm:time_to_first_token_seconds_count")
    assert latency["ttft"]["p50"] <= latency["ttft"]["p90"] <= latency["ttft"]["p99"]
    assert latency["e2e"]["p50"] <= latency["e2e"]["p99"]


def test_the_rates_show_the_tokens_of_a_request(server, client):
    reply = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, temperature=0)

    def generated_in_the_series() -> bool:
        """Once a tick after the request has sampled the totals, the series has its tokens in it."""
        rates = dashboard(server)["rates"]
        series = rates["engines"][0]
        assert len(series["generation_tokens"]) == len(rates["t"]) and all(r >= 0 for r in series["prompt_tokens"])
        return any(r > 0 for r in series["generation_tokens"]) and any(r > 0 for r in series["prompt_tokens"])

    assert reply.usage.completion_tokens == 16
    assert wait_until(generated_in_the_series, 30, 0.5)
    assert all(t <= 0 for t in dashboard(server)["rates"]["t"])


def test_the_pages_are_public_and_the_data_needs_a_user_key():
    policy = AuthPolicy(api_keys=("user-key-1",), admin_keys=("admin-key-1",))
    assert "/" in PAGE_PATHS and "/ui/app.js" in PAGE_PATHS and "/ui/vendor/uplot/LICENSE" in PAGE_PATHS
    for path in PAGE_PATHS:
        assert policy.check(path, None) is None, path
    assert policy.check("/dashboard.json", None)[0] == 401
    assert policy.check("/dashboard.json", "Bearer user-key-1") is None
    assert policy.check("/ui/not-a-file.js", None)[0] == 401  # only the app's own files are public
    assert policy.check("/ui/../dashboard.json", None)[0] == 401
