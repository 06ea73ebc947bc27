"""What the web dashboard costs the tokenizer process, against what its metrics already cost, in one run.

- Per delta (the hot path): the dashboard's record of one inter-token latency (`RecentActivity.observe`,
  a write into a fixed ring) against the Prometheus calls the same delta already makes (a histogram
  observe and a counter increment).
- Per poll (once a second per open dashboard): building GET /dashboard.json's report with every window
  full (300 rate points, a full ITL ring, 100 timeline entries) against rendering /metrics' text once.
- The loop's tick when no sample is due (every poll wake-up, twice a second at least).

    python benchmarks/dashboard.py
"""

from __future__ import annotations

import os
import time
import timeit

import msgspec

from pagoda.detok_proc.dashboard import TIMELINE_REQUESTS
from pagoda.detok_proc.metrics import DetokMetrics
from pagoda.detok_proc.sample import SampleState
from pagoda.engine_core import protocol


def per_call(statement, number: int, repeat: int = 5) -> float:
    """Best of `repeat` runs, seconds per call."""
    return min(timeit.repeat(statement, number=number, repeat=repeat)) / number


def filled_metrics() -> tuple[DetokMetrics, list[SampleState]]:
    stats = protocol.SchedulerStatsMessage(8, 2, 0.4, 1, prefix_cache_queries=1000, prefix_cache_hits=600)
    metrics = DetokMetrics("bench", lambda: [(True, stats)])
    metrics.engine_ready(0, protocol.EngineReady(1000, 16, 4096, 49152, "/models/x", pid=os.getpid()))
    activity = metrics.activity
    now = time.monotonic()
    itl = activity.latency["itl"]
    for i in range(len(itl.times)):  # a full ring, all inside the last minute
        itl.add(now - 50 + i * 1e-4, 0, 0.03)
    for i in range(2000):
        activity.observe("ttft", now - 50 + i * 0.02, 0, 0.2)
        activity.observe("e2e", now - 50 + i * 0.02, 0, 2.0)
    for i in range(301):
        activity.tick(now - 301 + i, metrics.numbers)
    running = []
    for i in range(TIMELINE_REQUESTS + 8):
        sample = SampleState(b"c", str(i), 0, None, num_prompt_tokens=100, stop_token_ids=frozenset(), logprobs=None)
        sample.timing.first_token = sample.timing.last_token = now
        sample.timing.queue_time = 0.01
        if i < TIMELINE_REQUESTS:
            metrics.finished(sample, protocol.FinishReason.STOP)
        else:
            running.append(sample)
    return metrics, running


def main() -> None:
    metrics, running = filled_metrics()
    itl, tokens = metrics.itl[0], metrics.generation_tokens[0]
    activity = metrics.activity
    now = time.monotonic()

    prometheus = per_call(lambda: (itl.observe(0.03), tokens.inc(1)), 200_000)
    record = per_call(lambda: activity.observe("itl", now, 0, 0.03), 200_000)
    print(
        f"per delta: Prometheus histogram + counter {prometheus * 1e9:.0f} ns, the dashboard's record "
        f"{record * 1e9:.0f} ns: {record / prometheus:.2f}x the metrics' own cost"
    )

    scrape = per_call(metrics.render, 200)
    report = per_call(lambda: msgspec.json.encode(metrics.dashboard(running)), 200)
    size = len(msgspec.json.encode(metrics.dashboard(running)))
    print(
        f"per poll: /metrics text {scrape * 1e3:.2f} ms, /dashboard.json with full windows {report * 1e3:.2f} ms "
        f"({size / 1024:.0f} KiB): {report / scrape:.2f}x a /metrics scrape"
    )

    tick = per_call(metrics.tick, 200_000)
    print(f"the loop's tick when no sample is due: {tick * 1e9:.0f} ns ({tick / prometheus:.2f}x one delta's metrics)")


if __name__ == "__main__":
    main()
