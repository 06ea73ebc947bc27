"""The server's Prometheus metrics, kept in the tokenizer process and rendered for every /metrics.

The tokenizer process is the one place that sees each engine step's scheduler stats and each
request's whole life, so the metrics of the whole server live here, in one CollectorRegistry; an HTTP
worker's /metrics asks for the rendered text (MetricsQuery -> MetricsReport).

- Scheduler state and the engine's cumulative counters (running, waiting, KV-cache usage, prefix-cache
  queries and hits, preemptions) are read at scrape time from the latest `StepOutputs.stats`: the
  engine's own numbers, one source of truth (DESIGN §1).
- Request metrics carry vLLM's names, types, labels (`model_name`, `engine`) and buckets, so dashboards
  built for vLLM work unchanged. `engine` is the index of the engine replica (`--data-parallel-size`)
  that ran the request or reports the stats: "0" with one engine; sum over it for the server's total.
  `pagoda:engine_up` is 1 for each replica that serves, 0 while it is down or restarting. As in vLLM,
  each of a request's `n` samples is one (engine) request here: it counts once in request_success,
  prompt_tokens and every per-request histogram.
- Counters only the HTTP layer knows (rejected with 429/413, aborted by a client disconnect, timed out)
  come from every worker as `ApiWorkerStats` snapshots, cumulative per worker, sent whenever one
  changes. The sum over workers is exported, so any worker's /metrics shows them all, and a snapshot
  can be neither lost nor counted twice in a way that matters (the latest one per worker wins).
- process_* metrics of every process (process_metrics.py).
- This process's own work: `pagoda:tokenizer_bytes` (text handed to the tokenizer, by where it ran:
  "inline" in the loop or on the "background" thread; a prompt refused from its length never counts)
  and `pagoda:metrics_renders` (how often this text was rendered: at most once per --metrics-interval,
  on a thread of its own, however often /metrics is asked for; metrics_cache.py).

Times are this process's time.monotonic(): a sample arrives when its request reaches this process
(before tokenization), a token when its step's message arrives here; queue time is the engine's own
(arrival in the engine to first scheduling), sent with a request's first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.detok_proc.dashboard import Numbers, RecentActivity, numbers_by_engine
from pagoda.detok_proc.process_metrics import ProcessesCollector
from pagoda.detok_proc.sample import SampleState
from pagoda.engine_core import protocol
from pagoda.engine_core.pooling.params import TASKS

disable_created_metrics()  # no *_created series (as vLLM): they double the output and no dashboard reads them

LABELS = ["model_name", "engine"]
REJECTED_STATUSES = (413, 429)  # exported from the start, at 0, so rate() works before the first one
# vLLM's buckets, so its dashboards' quantiles mean the same here.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


EngineStates = Callable[[], Sequence[tuple[bool, protocol.SchedulerStatsMessage]]]


class DetokMetrics:
    def __init__(
        self,
        model_name: str,
        engines: EngineStates,
        num_engines: int = 1,
        tokenizer_bytes: Callable[[], Mapping[str, int]] = dict,
    ):
        """`engines()`: (serving, latest stats) of each engine replica, read at scrape time;
        `tokenizer_bytes()`: the text handed to the tokenizer so far, by where it ran."""
        self.model_name = model_name
        self.num_engines = num_engines
        self.registry = CollectorRegistry()
        self.processes = ProcessesCollector()
        self.api_workers = ApiWorkerCounters(model_name)
        engine_stats = EngineStatsCollector(model_name, engines)
        self.device_memory = DeviceMemoryCollector(model_name)
        self.own_work = OwnWorkCollector(model_name, tokenizer_bytes)
        for collector in (engine_stats, self.device_memory, self.api_workers, self.processes, self.own_work):
            self.registry.register(collector)
        r = self.registry
        prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.prompt_tokens = self._per_engine(prompt_tokens)
        self.generation_tokens = self._per_engine(generation_tokens)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ["finished_reason"],
            registry=r,
        )
        self.request_success = [
            {reason: success.labels(model_name, str(engine), reason.value) for reason in protocol.FinishReason}
            for engine in range(num_engines)
        ]
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=r,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS,
            registry=r,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.ttft, self.itl, self.e2e, self.queue_time = (self._per_engine(h) for h in (ttft, itl, e2e, queue_time))
        # What the dashboard reads of /metrics' families (detok_proc/dashboard.py), and its own records.
        self._dashboard_families: list[Collector] = [
            engine_stats,
            self.device_memory,
            self.api_workers,
            prompt_tokens,
            generation_tokens,
            success,
            ttft,
            itl,
            e2e,
            queue_time,
        ]
        self.activity = RecentActivity(num_engines)
        # Token-count histograms need the context length for their buckets: made in engine_ready().
        self.request_prompt_tokens: list = []
        self.request_generation_tokens: list = []
        self._engine_pids: dict[int, int] = {}
        self.pooling_requests: Counter | None = None  # made in engine_ready for a pooling engine

    def _per_engine(self, metric):
        """The metric's child for each engine replica, by index."""
        return [metric.labels(self.model_name, str(engine)) for engine in range(self.num_engines)]

    def engine_ready(self, engine: int, ready: protocol.EngineReady) -> None:
        self.processes.add(ready.pid, "engine", engine)
        self._engine_pids[engine] = ready.pid
        if ready.device_memory_total:
            self.device_memory.engines[engine] = (ready.device_memory_used, ready.device_memory_total)
        if ready.pooling is not None and self.pooling_requests is None:
            self.pooling_requests = Counter(
                "pagoda:pooling_requests",
                "Pooling (embedding) requests served, one per input, by task (embed, token_embed).",
                LABELS + ["task"],
                registry=self.registry,
            )
            for task in TASKS:  # exported from the start, at 0, so rate() works before the first one
                for index in range(self.num_engines):
                    self.pooling_requests.labels(self.model_name, str(index), task)
        if not self.request_prompt_tokens:
            buckets = buckets_1_2_5(ready.max_model_len)
            self.request_prompt_tokens = self._per_engine(
                Histogram(
                    "vllm:request_prompt_tokens",
                    "Number of prefill tokens processed.",
                    LABELS,
                    registry=self.registry,
                    buckets=buckets,
                )
            )
            self.request_generation_tokens = self._per_engine(
                Histogram(
                    "vllm:request_generation_tokens",
                    "Number of generation tokens processed.",
                    LABELS,
                    registry=self.registry,
                    buckets=buckets,
                )
            )

    def engine_down(self, engine: int) -> None:
        """Its process is gone (or about to be): no more process_* samples for it."""
        pid = self._engine_pids.pop(engine, None)
        self.device_memory.engines.pop(engine, None)
        if pid is not None:
            self.processes.remove(pid)

    def api_worker_stats(self, stats: protocol.ApiWorkerStats) -> None:
        self.api_workers.update(stats)
        self.processes.add(stats.pid, "api", stats.worker)

    # ---- one sample's life -----------------------------------------------------------------------
    def tokens(self, sample: SampleState, delta: protocol.RequestDelta) -> None:
        """A delta of the engine reached `sample` (call once per delta, after sample.delta())."""
        if not delta.new_token_ids:
            return
        now, timing, engine = time.monotonic(), sample.timing, sample.engine
        if timing.first_token is None:  # prefill done: its prompt tokens count now (vLLM does the same)
            timing.first_token = now
            timing.queue_time = delta.queue_time
            self.ttft[engine].observe(now - timing.arrival)
            self.activity.observe("ttft", now, engine, now - timing.arrival)
            self.prompt_tokens[engine].inc(sample.num_prompt_tokens)
        else:
            self.itl[engine].observe(now - timing.last_token)
            self.activity.observe("itl", now, engine, now - timing.last_token)
        timing.last_token = now
        self.generation_tokens[engine].inc(len(delta.new_token_ids))

    def finished(self, sample: SampleState, finish_reason: protocol.FinishReason) -> None:
        """`sample` ended: STOP or LENGTH, or ABORT when its client aborted it. Samples ended by an
        error are not counted (as in vLLM, request_success counts requests that ran to an end)."""
        timing, engine, now = sample.timing, sample.engine, time.monotonic()
        self.request_success[engine][finish_reason].inc()
        self.e2e[engine].observe(now - timing.arrival)
        self.activity.observe("e2e", now, engine, now - timing.arrival)
        self.activity.sample_finished(sample, finish_reason.value, now)
        if timing.queue_time is not None:  # known once the sample's first token came
            self.queue_time[engine].observe(timing.queue_time)
        self.request_prompt_tokens[engine].observe(sample.num_prompt_tokens)
        self.request_generation_tokens[engine].observe(sample.num_output_tokens)

    def pooled(self, engine: int, num_prompt_tokens: int, arrival: float, queue_time: float | None, task: str) -> None:
        """One input of an embedding request has its vectors: a finished engine request (as vLLM counts
        pooling requests: request_success with reason "stop", its prompt tokens), and one more for
        pagoda:pooling_requests by task."""
        assert self.pooling_requests is not None  # (made when a pooling engine reported ready)
        self.pooling_requests.labels(self.model_name, str(engine), task).inc()
        self.prompt_tokens[engine].inc(num_prompt_tokens)
        self.request_success[engine][protocol.FinishReason.STOP].inc()
        self.e2e[engine].observe(time.monotonic() - arrival)
        if queue_time is not None:
            self.queue_time[engine].observe(queue_time)
        if self.request_prompt_tokens:
            self.request_prompt_tokens[engine].observe(num_prompt_tokens)

    def render(self) -> bytes:
        """Every metric in Prometheus' text format (counted in pagoda:metrics_renders, this one included).
        Safe to call from a thread beside the loop's (metrics_cache.py)."""
        self.own_work.renders += 1
        return generate_latest(self.registry)

    # ---- the web dashboard (detok_proc/dashboard.py) -------------------------------------------------
    def numbers(self) -> Numbers:
        """The dashboard's numbers of /metrics, now: per engine replica, and server-wide."""
        return numbers_by_engine(self._dashboard_families, self.num_engines)

    def tick(self) -> None:
        """Called from the loop, often: samples the totals the dashboard's rates need once a second."""
        self.activity.tick(time.monotonic(), self.numbers)

    def dashboard(self, in_flight: Iterable[SampleState]) -> dict:
        """The dashboard's report (GET /dashboard.json); `in_flight`: the samples running now."""
        return {"model": self.model_name, **self.activity.report(time.monotonic(), self.numbers(), in_flight)}


class OwnWorkCollector(Collector):
    """The tokenizer process's own work: text tokenized (by where it ran) and renders of /metrics."""

    def __init__(self, model_name: str, tokenizer_bytes: Callable[[], Mapping[str, int]]):
        self.model_name = model_name
        self.tokenizer_bytes = tokenizer_bytes
        self.renders = 0

    def collect(self) -> Iterable[Metric]:
        tokenized = CounterMetricFamily(
            "pagoda:tokenizer_bytes",
            "Bytes of text handed to the tokenizer (prompts, chat renders; 4 per token to detokenize), by "
            "where it ran: inline in the tokenizer process's loop, or on its background thread.",
            labels=["model_name", "path"],
        )
        for path, size in sorted(dict(self.tokenizer_bytes()).items()):
            tokenized.add_metric([self.model_name, path], size)
        yield tokenized
        renders = CounterMetricFamily(
            "pagoda:metrics_renders", "Renders of this text (one per --metrics-interval at most).", labels=LABELS[:1]
        )
        renders.add_metric([self.model_name], self.renders)
        yield renders


class EngineStatsCollector(Collector):
    """Each engine replica's scheduler gauges and cumulative counters, straight from its latest step
    stats (a replica that is down reports zeros; its restarted process counts from zero again, which
    Prometheus' rate() reads as a counter reset)."""

    def __init__(self, model_name: str, engines: EngineStates):
        self.model_name = model_name
        self.engines = engines

    def collect(self) -> Iterable[Metric]:
        engines = list(self.engines())
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
        ]
        counters = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_queries",
            ),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
        ]
        for family, (name, doc, attribute) in [(GaugeMetricFamily, g) for g in gauges] + [
            (CounterMetricFamily, c) for c in counters
        ]:
            metric = family(name, doc, labels=LABELS)
            for engine, (_, stats) in enumerate(engines):
                metric.add_metric([self.model_name, str(engine)], getattr(stats, attribute))
            yield metric
        yield from self._spec_decode(engines)
        if any(stats.state_pool_usage is not None for _, stats in engines):  # (models with recurrent layers)
            states = GaugeMetricFamily(
                "pagoda:recurrent_state_usage_perc",
                "Recurrent-state pool usage (one slot per running request). 1 means 100 percent usage.",
                labels=LABELS,
            )
            for engine, (_, stats) in enumerate(engines):
                states.add_metric([self.model_name, str(engine)], stats.state_pool_usage or 0.0)
            yield states
        up = GaugeMetricFamily("pagoda:engine_up", "1 while the engine replica serves, else 0.", labels=LABELS)
        for engine, (serving, _) in enumerate(engines):
            up.add_metric([self.model_name, str(engine)], 1.0 if serving else 0.0)
        yield up

    def _spec_decode(self, engines) -> Iterable[Metric]:
        """vLLM's speculative-decoding counters, when an engine speculates."""
        if not any(stats.spec_decode is not None for _, stats in engines):
            return
        counters = [
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
        ]
        for name, doc, attribute in counters:
            metric = CounterMetricFamily(name, doc, labels=LABELS)
            for engine, (_, stats) in enumerate(engines):
                if stats.spec_decode is not None:
                    metric.add_metric([self.model_name, str(engine)], getattr(stats.spec_decode, attribute))
            yield metric
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for engine, (_, stats) in enumerate(engines):
            if stats.spec_decode is not None:
                for position, count in enumerate(stats.spec_decode.accepted_per_position):
                    per_position.add_metric([self.model_name, str(engine), str(position)], count)
        yield per_position


class DeviceMemoryCollector(Collector):
    """Each engine replica's GPU memory as its EngineReady reported it (CUDA only: nothing is exported
    on the CPU), until it goes down."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engines: dict[int, tuple[int, int]] = {}  # engine -> (used, total) bytes

    def collect(self) -> Iterable[Metric]:
        if not self.engines:
            return
        used = GaugeMetricFamily(
            "pagoda:device_memory_used_bytes",
            "GPU memory the engine replica's allocator holds once ready (weights, KV cache, CUDA graphs).",
            labels=LABELS,
        )
        total = GaugeMetricFamily("pagoda:device_memory_total_bytes", "The engine replica's GPU memory.", labels=LABELS)
        for engine, (used_bytes, total_bytes) in sorted(self.engines.items()):
            used.add_metric([self.model_name, str(engine)], used_bytes)
            total.add_metric([self.model_name, str(engine)], total_bytes)
        yield used
        yield total


class ApiWorkerCounters(Collector):
    """The HTTP workers' counters: the latest cumulative snapshot of each worker, summed."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.workers: dict[int, protocol.ApiWorkerStats] = {}

    def update(self, stats: protocol.ApiWorkerStats) -> None:
        self.workers[stats.pid] = stats

    def collect(self) -> Iterable[Metric]:
        workers = list(self.workers.values())
        rejected = CounterMetricFamily(
            "pagoda:request_rejected",
            "Requests refused before any work, by HTTP status: 429 (server at capacity), 413 (body too large).",
            labels=["model_name", "status_code"],
        )
        statuses = set(REJECTED_STATUSES).union(*(w.rejected for w in workers))
        for status in sorted(statuses):
            rejected.add_metric([self.model_name, str(status)], sum(w.rejected.get(status, 0) for w in workers))
        yield rejected
        for name, doc, attribute in (
            (
                "pagoda:request_aborted",
                "Requests whose HTTP client disconnected before the response was "
                "complete (their generation is aborted).",
                "aborted",
            ),
            ("pagoda:request_timeout", "Requests ended by the server's request timeout (504).", "timed_out"),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], sum(getattr(w, attribute) for w in workers))
            yield counter
