"""The web dashboard's data (GET /dashboard.json): the numbers /metrics exports, and what happened in
the last minutes, kept in the tokenizer process beside the metrics (detok_proc/metrics.py).

- `numbers_by_engine`: the samples of metric families as /metrics renders them, read from the same
  collectors at the moment of the query (one source of truth), grouped by the `engine` label; sample
  names are /metrics' own (`vllm:prompt_tokens_total`), summed over any other label.
- `RecentActivity`: what Prometheus leaves to its server to compute (rate(), histogram_quantile()),
  from the metrics' own call sites: once a second the token and prefix-cache totals (5 minutes of
  rates), each TTFT / ITL / end-to-end observation of the last minute (exact percentiles), and the
  phases of the last 100 requests (the timeline).

Times are time.monotonic() of this process; the report gives them relative to its own `now` (seconds,
negative = in the past), so the browser never compares clocks with the server.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from prometheus_client.registry import Collector

from pagoda.detok_proc.sample import SampleState

RATE_SECONDS = 300  # the rate charts' span
TICK_SECONDS = 1.0  # how often the totals are sampled for the rates
LATENCY_SECONDS = 60.0  # the percentiles' window
TIMELINE_REQUESTS = 100
PERCENTILES = (50, 90, 99)
# Counters whose rates the dashboard charts: /metrics' sample names, and the short name in the report.
RATE_COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:num_preemptions_total": "preemptions",
}

Numbers = tuple[list[dict[str, float]], dict[str, float]]  # (per engine, server-wide)


def numbers_by_engine(collectors: Iterable[Collector], num_engines: int) -> Numbers:
    """Every sample of `collectors` (histogram buckets left out: their _count and _sum stay), summed per
    engine replica over the other labels; samples without an `engine` label are server-wide."""
    engines: list[dict[str, float]] = [{} for _ in range(num_engines)]
    server: dict[str, float] = {}
    for collector in collectors:
        for family in collector.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    continue
                engine = sample.labels.get("engine")
                target = server if engine is None else engines[int(engine)]
                target[sample.name] = target.get(sample.name, 0.0) + sample.value
    return engines, server


class TimedValues:
    """Observations (time, engine, value) in a ring of fixed size: the newest `capacity` are kept, so
    memory stays bounded however fast they come (the window then covers less than asked, and says so)."""

    def __init__(self, capacity: int):
        self.times = np.full(capacity, -np.inf)
        self.values = np.zeros(capacity)
        self.engines = np.zeros(capacity, dtype=np.int32)
        self.count = 0  # observations ever added

    def add(self, now: float, engine: int, value: float) -> None:
        i = self.count % len(self.times)
        self.times[i], self.engines[i], self.values[i] = now, engine, value
        self.count += 1

    def since(self, start: float) -> tuple[np.ndarray, np.ndarray, float]:
        """(values, engines) observed at `start` or later, and when the kept ones begin (`start`, or
        later if older observations in the window were pushed out)."""
        keep = self.times >= start
        covered = start
        if self.count > len(self.times):
            covered = max(start, float(self.times[self.count % len(self.times)]))
        return self.values[keep], self.engines[keep], covered


def percentiles(values: np.ndarray) -> dict[str, float | int | None]:
    """count, mean and the PERCENTILES of `values` (seconds); None where there is nothing to summarize."""
    summary: dict[str, float | int | None] = {"count": len(values)}
    if len(values):
        summary["mean"] = float(values.mean())
        for p, value in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True):
            summary[f"p{p}"] = float(value)
    else:
        summary["mean"] = None
        summary.update({f"p{p}": None for p in PERCENTILES})
    return summary


@dataclass(frozen=True)
class Phases:
    """One sample on the timeline (times as SampleTiming's; `end` and `finish_reason` None while it runs)."""

    engine: int
    arrival: float
    admitted: float
    queue_time: float | None
    first_token: float | None
    end: float | None
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None

    @classmethod
    def of(cls, sample: SampleState, end: float | None = None, finish_reason: str | None = None) -> Phases:
        t = sample.timing
        return cls(
            sample.engine,
            t.arrival,
            t.admitted,
            t.queue_time,
            t.first_token,
            end,
            sample.num_prompt_tokens,
            sample.num_output_tokens,
            finish_reason,
        )


class RecentActivity:
    def __init__(self, num_engines: int, itl_capacity: int = 1 << 17, request_capacity: int = 1 << 14):
        self.num_engines = num_engines
        self.latency = {
            "ttft": TimedValues(request_capacity),
            "itl": TimedValues(itl_capacity),
            "e2e": TimedValues(request_capacity),
        }
        # (time, per engine: {short name: total}) once a second; one more than the span, for its first rate
        self.totals: deque[tuple[float, list[dict[str, float]]]] = deque(maxlen=int(RATE_SECONDS / TICK_SECONDS) + 1)
        self.finished: deque[Phases] = deque(maxlen=TIMELINE_REQUESTS)

    # ---- recorded at the metrics' call sites -------------------------------------------------------
    def observe(self, kind: str, now: float, engine: int, seconds: float) -> None:
        self.latency[kind].add(now, engine, seconds)

    def sample_finished(self, sample: SampleState, finish_reason: str, now: float) -> None:
        self.finished.append(Phases.of(sample, now, finish_reason))

    def tick(self, now: float, numbers: Callable[[], Numbers]) -> None:
        """Sample the rate counters if a second has passed since the last time (`numbers()` is read then only)."""
        if self.totals and now - self.totals[-1][0] < TICK_SECONDS:
            return
        engines, _ = numbers()
        self.totals.append((now, [{short: e.get(name, 0.0) for name, short in RATE_COUNTERS.items()} for e in engines]))

    # ---- the report --------------------------------------------------------------------------------
    def report(self, now: float, numbers: Numbers, in_flight: Iterable[SampleState]) -> dict:
        engines, server = numbers
        return {
            "now": now,
            "engines": [{"engine": i, "metrics": values} for i, values in enumerate(engines)],
            "server": server,
            "rates": self._rates(now),
            "latency": self._latency(now),
            "timeline": self._timeline(now, in_flight),
        }

    def _rates(self, now: float) -> dict:
        """Per engine and counter, the rate (per second) between consecutive samples of the totals, at
        the later one's time. A counter that went down (a restarted replica's engine counters start
        from zero again) reads as a reset, as Prometheus' rate() does: its new value is the increase."""
        points = list(self.totals)
        times = [t - now for t, _ in points[1:]]
        per_engine = []
        for engine in range(self.num_engines):
            series: dict[str, list[float]] = {short: [] for short in RATE_COUNTERS.values()}
            for (t0, before), (t1, after) in itertools.pairwise(points):
                for short in series:
                    was, now_total = before[engine][short], after[engine][short]
                    increase = now_total - was if now_total >= was else now_total
                    series[short].append(increase / (t1 - t0))
            per_engine.append(series)
        return {"t": times, "engines": per_engine}

    def _latency(self, now: float) -> dict:
        out: dict = {"window_seconds": LATENCY_SECONDS}
        for kind, observations in self.latency.items():
            values, engines, covered = observations.since(now - LATENCY_SECONDS)
            out[kind] = percentiles(values)
            out[kind]["covered_seconds"] = now - covered
            if self.num_engines > 1:
                out[kind]["by_engine"] = [percentiles(values[engines == e]) for e in range(self.num_engines)]
        return out

    def _timeline(self, now: float, in_flight: Iterable[SampleState]) -> list[dict]:
        """The last TIMELINE_REQUESTS samples by arrival, running ones included: their phases as
        times relative to `now` (null: not reached yet). `scheduled` is when the engine first scheduled
        it (its queue time after it was handed over; never after its first token)."""
        entries = list(self.finished) + [Phases.of(sample) for sample in in_flight]
        entries.sort(key=lambda e: e.arrival)

        def rel(t: float | None) -> float | None:
            return None if t is None else t - now

        out = []
        for e in entries[-TIMELINE_REQUESTS:]:
            scheduled = None
            if e.queue_time is not None:
                scheduled = e.admitted + e.queue_time
                if e.first_token is not None:
                    scheduled = min(scheduled, e.first_token)
            out.append(
                {
                    "engine": e.engine,
                    "arrival": rel(e.arrival),
                    "admitted": rel(e.admitted),
                    "scheduled": rel(scheduled),
                    "first_token": rel(e.first_token),
                    "end": rel(e.end),
                    "prompt_tokens": e.prompt_tokens,
                    "output_tokens": e.output_tokens,
                    "finish_reason": e.finish_reason,
                }
            )
        return out
