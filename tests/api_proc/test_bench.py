"""The benchmark harness: exact counts against a null SSE server and a live Pagoda; failures counted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from api_proc.bench.datasets import prefix_requests, random_requests, synthetic_sharegpt
from api_proc.bench.local_server import free_port
from api_proc.bench.metrics import parse_goodput, summarize
from api_proc.bench.null_server import NullServer
from api_proc.bench.runner import run_serve


def test_256_concurrent_streams_counted_exactly():
    server = NullServer(free_port())
    try:
        requests = random_requests(256, 4, 200, seed=1)
        results, duration, model = asyncio.run(run_serve(server.url, requests, progress=False))
    finally:
        server.stop()
    summary = summarize(results, duration)
    assert model == "null-model" and summary["completed"] == 256 and summary["failed"] == 0
    assert summary["output_tokens"] == 256 * 200
    assert all(len(r.chunk_times) == 200 and r.ttft <= r.e2el for r in results)


def test_datasets_are_deterministic_and_exact():
    a, b = random_requests(8, 100, 20, range_ratio=0.5, seed=3), random_requests(8, 100, 20, range_ratio=0.5, seed=3)
    assert a == b and all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in a)
    shared = prefix_requests(4, 64, 8, 5)
    assert all(r.prompt[:64] == shared[0].prompt[:64] and r.prompt_len == 72 for r in shared)
    synthetic = synthetic_sharegpt(200, seed=0)
    assert synthetic == synthetic_sharegpt(200, seed=0)
    lengths = sorted(r.output_len for r in synthetic)
    assert 100 < lengths[100] < 300 and lengths[-1] > 2 * lengths[100]  # a long tail, like ShareGPT's
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_against_live_pagoda_counts_are_consistent(server):
    requests = random_requests(16, 24, 6, range_ratio=0.5, seed=2)
    results, duration, _ = asyncio.run(
        run_serve(server.base_url + "/v1", requests, max_concurrency=8, request_rate=50.0, progress=False)
    )
    summary = summarize(results, duration, parse_goodput(["ttft:100000"]))
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(r.output_len for r in requests) == sum(r.output_len for r in results)
    assert summary["input_tokens"] == sum(r.prompt_len for r in requests)
    assert all(0 < r.ttft <= r.e2el for r in results)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])


def test_server_errors_are_failures_not_crashes(server):
    requests = random_requests(3, 10, 4, seed=4) + random_requests(2, 9000, 4, seed=5)  # too long for the context
    results, duration, _ = asyncio.run(run_serve(server.base_url, requests, progress=False))
    summary = summarize(results, duration)
    assert summary["completed"] == 3 and summary["failed"] == 2
    assert all("HTTP 400" in r.error for r in results if not r.success)


def test_cli_saves_results_and_plots(server, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "api_proc.cli",
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--endpoint",
            "chat",
            "--dataset-name",
            "sharegpt",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--tokenizer",
            str(server.model_dir()),
            "--save-result",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "Successful requests:" in run.stdout and "Median TTFT (ms):" in run.stdout
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 4 and len(saved["requests"]) == 4
    assert png.stat().st_size > 10_000


def test_offline_throughput_and_latency_commands(tmp_path, default_model_dir):
    from api_proc.cli import main

    out = tmp_path / "throughput.json"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--model",
                str(default_model_dir),
                "--kv-cache-memory",
                "128MiB",
                "--dataset-name",
                "prefix",
                "--prefix-len",
                "32",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--num-prompts",
                "6",
                "--save-result",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["requests"] == 6 and result["output_tokens"] == 24 and result["input_tokens"] == 6 * 40
    out = tmp_path / "latency.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                str(default_model_dir),
                "--kv-cache-memory",
                "128MiB",
                "--batch-size",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "4",
                "--num-iters",
                "2",
                "--save-result",
                str(out),
            ]
        )
        == 0
    )
    latency = json.loads(out.read_text())
    assert len(latency["latencies_s"]) == 2 and 0 < latency["median_s"] <= max(latency["latencies_s"])
