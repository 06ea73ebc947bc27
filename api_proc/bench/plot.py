"""`--plot FILE.png`: latency CDFs, output tokens/s over time, and requests in flight over time."""

from __future__ import annotations

import numpy as np

from pagoda.api_proc.bench.client import RequestResult


def plot_run(results: list[RequestResult], duration: float, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from exc
    done = [r for r in results if r.success]
    fig, (cdf, rate, flight) = plt.subplots(3, 1, figsize=(9, 11))
    fig.suptitle(title)
    for label, values in (
        ("TTFT", [r.ttft for r in done]),
        ("TPOT", [r.tpot for r in done if r.tpot]),
        ("E2E latency", [r.e2el for r in done]),
    ):
        if values:
            xs = np.sort(np.asarray(values) * 1000.0)
            cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    cdf.set_xscale("log")
    cdf.set_xlabel("milliseconds")
    cdf.set_ylabel("fraction of requests")
    cdf.legend()
    cdf.grid(True, alpha=0.3)

    arrivals = np.asarray([r.start + t for r in done for t in r.chunk_times])
    seconds = max(1, int(np.ceil(duration)))
    counts, edges = np.histogram(arrivals, bins=seconds, range=(0, seconds))
    rate.plot(edges[:-1], counts)
    rate.set_xlabel("seconds since start")
    rate.set_ylabel("streamed chunks (≈ tokens) per second")
    rate.grid(True, alpha=0.3)

    times = np.linspace(0, duration, 400)
    starts = np.asarray([r.start for r in results])
    ends = starts + np.asarray([r.e2el for r in results])
    flight.plot(times, [(np.sum((starts <= t) & (ends > t))) for t in times])
    flight.set_xlabel("seconds since start")
    flight.set_ylabel("requests in flight")
    flight.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
