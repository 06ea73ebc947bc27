"""detok_proc/metrics.py on its own: how several HTTP workers' counters and the engine's stats render.
(The end-to-end behaviour, through a real server, is tests/api_proc/test_metrics.py.)"""

from __future__ import annotations

import os

from prometheus_client.parser import text_string_to_metric_families

from pagoda.detok_proc.metrics import DetokMetrics, buckets_1_2_5
from pagoda.detok_proc.sample import SampleState
from pagoda.engine_core import protocol

MODEL = "my-model"
GONE_PID = 2**22 + 12345  # above Linux's largest pid: a worker that has exited


def values(metrics: DetokMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_worker_snapshots_are_summed_and_the_latest_one_per_worker_wins():
    metrics = DetokMetrics(MODEL, lambda: [(True, protocol.SchedulerStatsMessage(0, 0, 0.0, 0))])
    me = os.getpid()
    metrics.api_worker_stats(protocol.ApiWorkerStats(pid=me, rejected={429: 1}, aborted=2))
    metrics.api_worker_stats(protocol.ApiWorkerStats(pid=GONE_PID, rejected={429: 3, 413: 1}, timed_out=1))
    metrics.api_worker_stats(protocol.ApiWorkerStats(pid=me, rejected={429: 1}, aborted=2))  # sent again
    got = values(metrics)
    assert got[("pagoda:request_rejected_total", (("model_name", MODEL), ("status_code", "429")))] == 4
    assert got[("pagoda:request_rejected_total", (("model_name", MODEL), ("status_code", "413")))] == 1
    assert got[("pagoda:request_aborted_total", (("model_name", MODEL),))] == 2
    assert got[("pagoda:request_timeout_total", (("model_name", MODEL),))] == 1
    cpu = {labels: v for (name, labels), v in got.items() if name == "process_cpu_seconds_total"}
    # This process is both "detok" and an "api" worker here; the exited worker just has no sample.
    assert set(cpu) == {(("index", "0"), ("process", "detok"))}  # no pid: /metrics is public


def test_engine_stats_are_read_at_scrape_time_and_token_buckets_follow_the_context():
    stats = protocol.SchedulerStatsMessage(3, 2, 0.25, 4, prefix_cache_queries=100, prefix_cache_hits=64)
    metrics = DetokMetrics(MODEL, lambda: [(True, stats)])
    metrics.engine_ready(0, protocol.EngineReady(10, 16, 2048, 1000, "/models/x", pid=os.getpid()))
    got = values(metrics)
    labels = (("engine", "0"), ("model_name", MODEL))
    assert got[("vllm:num_requests_running", labels)] == 3
    assert got[("vllm:num_requests_waiting", labels)] == 2
    assert got[("vllm:kv_cache_usage_perc", labels)] == 0.25
    assert got[("vllm:num_preemptions_total", labels)] == 4
    assert got[("vllm:prefix_cache_queries_total", labels)] == 100
    assert got[("vllm:prefix_cache_hits_total", labels)] == 64
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    les = [dict(labels)["le"] for (name, labels) in got if name == "vllm:request_prompt_tokens_bucket"]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "+Inf"]


def test_each_engine_replica_has_its_own_series():
    """Data parallel: stats and request metrics carry the replica's index as `engine`; a replica that is
    down reports engine_up 0 and zeros."""
    busy = protocol.SchedulerStatsMessage(2, 1, 0.5, 0, prefix_cache_queries=32, prefix_cache_hits=16)
    metrics = DetokMetrics(MODEL, lambda: [(True, busy), (False, protocol.SchedulerStatsMessage(0, 0, 0.0, 0))], 2)
    metrics.engine_ready(0, protocol.EngineReady(10, 16, 2048, 1000, "/models/x", pid=os.getpid()))
    sample = SampleState(b"client", "r", 0, None, num_prompt_tokens=7, stop_token_ids=frozenset(), logprobs=None)
    sample.engine = 1
    metrics.tokens(sample, protocol.RequestDelta("e", [5, 6]))
    metrics.finished(sample, protocol.FinishReason.LENGTH)
    got = values(metrics)

    def labels(engine: str, **more: str) -> tuple:
        return tuple(sorted({"engine": engine, "model_name": MODEL, **more}.items()))

    assert got[("vllm:num_requests_running", labels("0"))] == 2
    assert got[("vllm:prefix_cache_hits_total", labels("0"))] == 16
    assert got[("vllm:num_requests_running", labels("1"))] == 0
    assert got[("pagoda:engine_up", labels("0"))] == 1 and got[("pagoda:engine_up", labels("1"))] == 0
    assert got[("vllm:prompt_tokens_total", labels("1"))] == 7 and got[("vllm:prompt_tokens_total", labels("0"))] == 0
    assert got[("vllm:generation_tokens_total", labels("1"))] == 2
    assert got[("vllm:request_success_total", labels("1", finished_reason="length"))] == 1
    assert got[("vllm:request_success_total", labels("0", finished_reason="length"))] == 0
    assert got[("vllm:request_prompt_tokens_count", labels("1"))] == 1
