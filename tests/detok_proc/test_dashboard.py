"""detok_proc/dashboard.py on its own: the dashboard's numbers are /metrics' numbers, the latency windows
give exact percentiles of what they hold, rates come from totals sampled once a second, and the
timeline keeps the last 100 samples' phases. (Through a real server: tests/api_proc/test_dashboard_data.py.)"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.detok_proc.dashboard import RATE_SECONDS, TIMELINE_REQUESTS, RecentActivity, TimedValues
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.sample import SampleState
from pagoda.engine_core import protocol

MODEL = "my-model"


def sample(engine: int = 0, prompt_tokens: int = 7) -> SampleState:
    state = SampleState(
        b"client", "r", 0, None, num_prompt_tokens=prompt_tokens, stop_token_ids=frozenset(), logprobs=None
    )
    state.engine = engine
    return state


def test_the_numbers_are_what_metrics_renders_per_engine():
    busy = protocol.SchedulerStatsMessage(2, 1, 0.5, 3, prefix_cache_queries=32, prefix_cache_hits=16)
    idle = protocol.SchedulerStatsMessage(0, 0, 0.0, 0)
    metrics = DetokMetrics(MODEL, lambda: [(True, busy), (False, idle)], 2)
    metrics.engine_ready(0, protocol.EngineReady(10, 16, 2048, 1000, "/models/x", pid=os.getpid()))
    metrics.api_worker_stats(protocol.ApiWorkerStats(pid=os.getpid(), rejected={429: 2}, aborted=1))
    for engine, reason in (
        (1, protocol.FinishReason.LENGTH),
        (1, protocol.FinishReason.STOP),
        (0, protocol.FinishReason.ABORT),
    ):
        s = sample(engine)
        metrics.tokens(s, protocol.RequestDelta("e", [5]))
        metrics.tokens(s, protocol.RequestDelta("e", [6, 7]))
        metrics.finished(s, reason)
    rendered: dict = defaultdict(float)  # (engine or None, sample name) -> summed over the other labels
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            rendered[(s.labels.get("engine"), s.name)] += s.value
    engines, server = metrics.numbers()
    assert len(engines) == 2
    for engine, values in enumerate(engines):
        for name, value in values.items():
            assert value == rendered[(str(engine), name)], name
    for name, value in server.items():
        assert value == rendered[(None, name)], name
    assert engines[1]["vllm:generation_tokens_total"] == 6 and engines[1]["vllm:request_success_total"] == 2
    assert engines[0]["vllm:num_preemptions_total"] == 3 and engines[1]["pagoda:engine_up"] == 0
    assert engines[1]["vllm:time_to_first_token_seconds_count"] == 2
    assert server["pagoda:request_rejected_total"] == 2 and server["pagoda:request_aborted_total"] == 1
    assert not any(name.endswith("_bucket") for values in engines for name in values)
    report = metrics.dashboard([])
    assert report["model"] == MODEL and report["engines"][1]["metrics"] == engines[1]
    assert report["latency"]["itl"]["count"] == 3 and len(report["latency"]["itl"]["by_engine"]) == 2
    assert [e["finish_reason"] for e in report["timeline"]] == ["length", "stop", "abort"]


def test_latency_percentiles_are_exact_over_the_last_minute_per_engine():
    activity = RecentActivity(num_engines=2)
    rng = np.random.default_rng(0)
    old = rng.uniform(5, 10, 50)  # 61-70 s before "now": outside the window
    recent = rng.uniform(0, 1, 200)
    for i, value in enumerate(old):
        activity.observe("ttft", 1000.0 + i * 0.1, 0, value)
    for i, value in enumerate(recent):
        activity.observe("ttft", 1020.0 + i * 0.1, i % 2, value)
    summary = activity.report(1080.0, ([{}, {}], {}), [])["latency"]["ttft"]
    assert summary["count"] == 200 and summary["mean"] == pytest.approx(recent.mean())
    assert [summary["p50"], summary["p90"], summary["p99"]] == pytest.approx(np.percentile(recent, [50, 90, 99]))
    assert summary["covered_seconds"] == 60.0
    engine_1 = summary["by_engine"][1]
    assert engine_1["count"] == 100 and engine_1["p50"] == pytest.approx(np.percentile(recent[1::2], 50))
    empty = activity.report(1080.0, ([{}, {}], {}), [])["latency"]["e2e"]
    assert empty["count"] == 0 and empty["p99"] is None and empty["mean"] is None


def test_a_full_ring_keeps_the_newest_and_says_what_it_covers():
    ring = TimedValues(capacity=4)
    for t in range(1, 7):
        ring.add(float(t), 0, t * 10.0)
    values, engines, covered = ring.since(0.0)
    assert list(engines) == [0, 0, 0, 0]
    assert sorted(values) == [30.0, 40.0, 50.0, 60.0] and covered == 3.0
    values, _, covered = ring.since(4.5)
    assert sorted(values) == [50.0, 60.0] and covered == 4.5


def test_rates_come_from_totals_sampled_once_a_second():
    activity = RecentActivity(num_engines=1)
    reads = []
    totals = iter([0.0, 10.0, 40.0, 5.0])  # generation tokens at each read; the last read: a restarted counter

    def numbers():
        value = next(totals)
        reads.append(value)
        return [{"vllm:generation_tokens_total": value}], {}

    for t in (100.0, 100.5, 101.0, 102.5, 102.9, 103.5):
        activity.tick(t, numbers)
    assert reads == [0.0, 10.0, 40.0, 5.0]  # 100.5 and 102.9 came too soon: nothing was read
    rates = activity.report(104.0, ([{}], {}), [])["rates"]
    assert rates["t"] == [-3.0, -1.5, -0.5]
    assert rates["engines"][0]["generation_tokens"] == [10.0, 20.0, 5.0]  # the reset counts its new value
    assert rates["engines"][0]["prompt_tokens"] == [0.0, 0.0, 0.0]
    for t in range(200, 200 + 2 * RATE_SECONDS):
        activity.tick(float(t), lambda: ([{}], {}))
    assert len(activity.report(600.0, ([{}], {}), [])["rates"]["t"]) == RATE_SECONDS


def test_the_timeline_holds_the_last_100_samples_with_their_phases():
    activity = RecentActivity(num_engines=1)
    for i in range(TIMELINE_REQUESTS + 20):
        s = sample(prompt_tokens=i + 1)
        t = s.timing
        t.arrival, t.admitted, t.first_token, t.queue_time = 10.0 + i, 10.2 + i, 10.5 + i, 0.1
        s.num_output_tokens = 3
        activity.sample_finished(s, "stop", 11.0 + i)
    running = sample(prompt_tokens=999)
    running.timing.arrival, running.timing.admitted = 200.0, 200.1  # not yet scheduled (no first token)
    late = sample(prompt_tokens=5)  # its queue time runs past its first token as this process saw it
    late.timing.arrival, late.timing.admitted, late.timing.first_token, late.timing.queue_time = (
        199.0,
        199.1,
        199.2,
        0.5,
    )
    timeline = activity.report(201.0, ([{}], {}), [running, late])["timeline"]
    assert len(timeline) == TIMELINE_REQUESTS
    assert [e["prompt_tokens"] for e in timeline[-3:]] == [120, 5, 999]  # by arrival, the running ones last
    first = timeline[0]
    assert first["prompt_tokens"] == 23 and first["finish_reason"] == "stop" and first["output_tokens"] == 3
    assert first["arrival"] == pytest.approx(32.0 - 201.0) and first["end"] == pytest.approx(33.0 - 201.0)
    assert first["scheduled"] == pytest.approx(32.3 - 201.0) and first["first_token"] == pytest.approx(32.5 - 201.0)
    assert timeline[-2]["scheduled"] == timeline[-2]["first_token"] == pytest.approx(-1.8)
    last = timeline[-1]
    assert last["end"] is None and last["finish_reason"] is None and last["first_token"] is None
    assert last["scheduled"] is None and last["admitted"] == pytest.approx(-0.9)


def test_gpu_memory_is_exported_only_for_replicas_that_report_it():
    idle = protocol.SchedulerStatsMessage(0, 0, 0.0, 0)
    metrics = DetokMetrics(MODEL, lambda: [(True, idle), (True, idle)], 2)
    metrics.engine_ready(0, protocol.EngineReady(10, 16, 2048, 1000, "/models/x", pid=os.getpid()))  # the CPU
    assert "device_memory" not in metrics.render().decode()
    gib = 2**30
    ready = protocol.EngineReady(10, 16, 2048, 1000, "/m", pid=os.getpid(), device_memory_used=60 * gib)
    ready.device_memory_total = 141 * gib
    metrics.engine_ready(1, ready)
    engines, _ = metrics.numbers()
    assert "pagoda:device_memory_used_bytes" not in engines[0]
    assert engines[1]["pagoda:device_memory_used_bytes"] == 60 * gib
    assert engines[1]["pagoda:device_memory_total_bytes"] == 141 * gib
    assert 'pagoda:device_memory_total_bytes{engine="1",model_name="my-model"}' in metrics.render().decode()
    metrics.engine_down(1)
    assert "device_memory" not in metrics.render().decode()
