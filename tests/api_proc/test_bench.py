"""The benchmark harness: exact counts against a null SSE server and a live Pagoda; failures counted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagoda.api_proc.bench.datasets import prefix_requests, random_requests, synthetic_sharegpt
from pagoda.api_proc.bench.local_server import free_port
from pagoda.api_proc.bench.metrics import parse_goodput, summarize
from pagoda.api_proc.bench.null_server import NullServer
from pagoda.api_proc.bench.runner import run_serve


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
            "pagoda.api_proc.cli",
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


def test_offline_throughput_and_latency_commands(tmp_path, default_model_dir, cli_main):
    out = tmp_path / "throughput.json"
    assert (
        cli_main(
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
        cli_main(
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


def test_vllms_documented_command_line_runs_and_saves_vllms_keys(server, tmp_path):
    """`vllm bench serve --backend openai --model X --dataset-name random --random-input-len 32
    --random-output-len 8 --num-prompts 8 --save-result --result-dir D`, with `pagoda` for `vllm` (and
    --host/--port for vLLM's default localhost:8000)."""
    from pagoda.api_proc.bench.local_server import MODEL_NAME

    result_dir = tmp_path / "results"
    line = (
        f"bench serve --backend openai --model {MODEL_NAME} --host 127.0.0.1 --port {server.port} "
        f"--dataset-name random --random-input-len 32 --random-output-len 8 --random-range-ratio 0.25 "
        f"--num-prompts 8 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99.9 "
        f"--save-result --result-dir {result_dir}"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", *line.split()], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    (saved_file,) = result_dir.iterdir()
    assert saved_file.name.startswith("openai-infqps-") and saved_file.suffix == ".json"  # vLLM's default name
    saved = json.loads(saved_file.read_text())
    assert saved["completed"] == 8 and saved["num_prompts"] == 8 and saved["backend"] == "openai"
    # Lengths in [len * 0.75, len * 1.25]; ignore_eos: every output has the length it asked for.
    assert saved["total_output_tokens"] == sum(saved["output_lens"]) and all(6 <= n <= 10 for n in saved["output_lens"])
    assert saved["total_input_tokens"] == sum(saved["input_lens"]) and all(24 <= n <= 40 for n in saved["input_lens"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert isinstance(saved[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert saved["p99.9_ttft_ms"] >= saved["p50_ttft_ms"] == saved["median_ttft_ms"] > 0
    assert saved["output_throughput"] > 0 and saved["duration"] > 0 and len(saved["itls"]) == 8
    assert saved["summary"]["completed"] == 8  # Pagoda's own keys are still there


def test_vllm_spellings_are_aliases(tmp_path):
    from pagoda.api_proc.bench import vllm_compat
    from pagoda.api_proc.cli import build_parser

    def parsed(line: str):
        args = build_parser().parse_args(["bench", "serve", *line.split()])
        vllm_compat.resolve(args)
        return args

    args = parsed("--random-input-len 7 --random-output-len 3 --random-range-ratio 0.5 --backend openai-chat")
    assert (args.input_len, args.output_len, args.range_ratio, args.endpoint) == (7, 3, 0.5, "chat")
    assert parsed("--endpoint /v1/chat/completions").endpoint == "chat"
    assert parsed("").base_url == "http://127.0.0.1:8000" and parsed("").save_result is None
    assert parsed(f"--save-result {tmp_path}/a.json").save_result == f"{tmp_path}/a.json"  # Pagoda's spelling
    args = parsed(f"--save-result --result-dir {tmp_path} --result-filename b.json")
    assert vllm_compat.result_path(args, "m") == tmp_path / "b.json"
    with pytest.raises(SystemExit):
        parsed("--base-url http://x:1 --port 2")
    with pytest.raises(SystemExit):
        parsed("--percentile-metrics ttft,latency")
