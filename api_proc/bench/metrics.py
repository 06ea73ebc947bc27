"""Summary statistics of a benchmark run, the same ones `vllm bench serve` reports."""

from __future__ import annotations

import numpy as np

from pagoda.api_proc.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:100"] -> {"ttft": 0.5, "tpot": 0.1} (seconds); keys ttft, tpot, e2el."""
    slo = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {spec!r}")
        slo[key] = float(value) / 1000.0
    return slo


def _meets(result: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return result.success and all(values[k] <= limit for k, limit in slo.items())


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    array = np.asarray(values) * 1000.0  # milliseconds
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES},
    }


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats([x for r in done for x in r.itl]),
        "e2el_ms": _stats([r.e2el for r in done]),
    }
    if slo:
        summary["goodput"] = sum(_meets(r, slo) for r in results) / duration
    return summary


def format_report(summary: dict, title: str) -> str:
    lines = [f"{'=' * 20} {title} {'=' * 20}"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:>14.2f}" if isinstance(value, float) else f"{label:<40}{value:>14}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["input_tokens"])
    row("Total generated tokens:", summary["output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "goodput" in summary:
        row("Request goodput (req/s):", summary["goodput"])
    row("Input token throughput (tok/s):", summary["input_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_throughput"])
    for key, name in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append(f"{'-' * 10} {name} {'-' * 10}")
        stats = summary[key]
        short = key.split("_")[0].upper()
        row(f"Mean {short} (ms):", stats["mean"])
        row(f"Median {short} (ms):", stats["median"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {short} (ms):", stats[f"p{p}"])
    lines.append("=" * (42 + len(title)))
    return "\n".join(lines)
