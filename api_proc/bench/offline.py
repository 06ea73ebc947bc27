"""`pagoda bench throughput` and `pagoda bench latency`: the engine in this process, no server."""

from __future__ import annotations

import time

import numpy as np

from pagoda.api_proc.bench.datasets import BenchRequest, random_requests


def _prompt(request: BenchRequest):
    return request.prompt if isinstance(request.prompt, str) else {"prompt_token_ids": request.prompt}


def run_throughput(llm, requests: list[BenchRequest], ignore_eos: bool = True) -> dict:
    """Every request at once through `llm.generate`; tokens counted from the outputs."""
    from pagoda.engine_core.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=ignore_eos) for r in requests]
    llm.generate(
        [_prompt(r) for r in requests[:2]], [SamplingParams(max_tokens=2)] * min(2, len(requests)), use_tqdm=False
    )  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([_prompt(r) for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_s": elapsed,
        "requests": len(requests),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_throughput": (input_tokens + output_tokens) / elapsed,
    }


def run_latency(
    llm, batch_size: int, input_len: int, output_len: int, num_iters: int = 5, num_warmup: int = 1, seed: int = 0
) -> dict:
    """One batch of `batch_size` random prompts end to end, `num_iters` times (after warm-ups)."""
    from pagoda.engine_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    latencies = []
    for i in range(num_warmup + num_iters):
        batch = random_requests(batch_size, input_len, output_len, seed=seed + i)
        start = time.perf_counter()
        llm.generate([_prompt(r) for r in batch], params, use_tqdm=False)
        if i >= num_warmup:
            latencies.append(time.perf_counter() - start)
    array = np.asarray(latencies)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "iterations": num_iters,
        "mean_s": float(array.mean()),
        "median_s": float(np.median(array)),
        "p90_s": float(np.percentile(array, 90)),
        "p99_s": float(np.percentile(array, 99)),
        "latencies_s": latencies,
    }
