"""One workload, Pagoda and baselines in the same run, a ratio table at the end.

Pagoda is started here (`pagoda serve`) and measured with the bundled harness (`pagoda bench serve`
code, streaming over HTTP). Baselines:
  hf        HF transformers `generate` in this process (static batches of --concurrency), always;
  NAME=URL  any OpenAI-compatible server, measured with the same harness and workload
            (e.g. a vLLM CPU server started by benchmarks/peers/vllm_cpu.sh: vllm=http://127.0.0.1:8001).

    python benchmarks/compare.py --num-prompts 64 --input-len 128 --output-len 128 --concurrency 16
    python benchmarks/compare.py --baseline vllm=http://127.0.0.1:8001 --model-name smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from pagoda.api_proc.bench.datasets import random_requests
from pagoda.api_proc.bench.local_server import PagodaServer
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve


def measure_server(url: str, requests, concurrency: int, model: str | None) -> dict:
    results, duration, _ = asyncio.run(
        run_serve(url, requests, max_concurrency=concurrency, model=model, progress=False)
    )
    summary = summarize(results, duration)
    return {
        "output_tok_s": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["median"],
        "tpot_p50_ms": summary["tpot_ms"]["median"],
        "failed": summary["failed"],
    }


def measure_hf(requests, batch_size: int) -> dict:
    import torch
    from throughput import run_hf
    from transformers import AutoModelForCausalLM

    from pagoda.engine_core.default_model import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_default_model()), dtype=torch.float32).eval()
    work = [(r.prompt, r.output_len) for r in requests]
    result = run_hf(model, work, batch_size)
    return {
        "output_tok_s": result["output_tok_s"],
        "ttft_p50_ms": float("nan"),
        "tpot_p50_ms": float("nan"),
        "failed": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--baseline", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--model-name", default=None, help="model name the URL baselines serve")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompts' seed (default: a new one each run, printed: a baseline server that keeps running would "
        "otherwise find a repeated run's prompts in its prefix cache, while Pagoda starts empty)",
    )
    parser.add_argument("--server-args", default="", help='extra `pagoda serve` flags, e.g. "--max-num-seqs 32"')
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds between Pagoda's ready and the first request (default 0). A server in service has been "
        "up a while, and its idle time maps its KV pool's pages (engine_core/kv_prefault.py: ~3-5 s for the "
        "2 GiB pool here), as vLLM's start-up writes its own; 0 measures a server just started",
    )
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"prompts: seed {seed}", flush=True)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, seed=seed)
    rows = {}
    server = PagodaServer(
        Path(tempfile.mkdtemp(prefix="pagoda-compare-")),
        "--kv-cache-memory",
        "2GiB",
        *args.server_args.split(),
        remove_dir_on_stop=True,
    )
    try:
        time.sleep(args.settle)
        rows["pagoda"] = measure_server(server.base_url, requests, args.concurrency, None)
    finally:
        server.stop()
    for spec in args.baseline:
        name, _, url = spec.partition("=")
        rows[name] = measure_server(url, requests, args.concurrency, args.model_name)
    if not args.skip_hf:
        rows["hf (in-process, static batches)"] = measure_hf(requests, args.concurrency)
    print(f"\n{args.num_prompts} x {args.input_len} -> {args.output_len} tokens, concurrency {args.concurrency}")
    print(f"  {'system':34} {'out tok/s':>10} {'TTFT p50':>10} {'TPOT p50':>10} {'failed':>7} {'pagoda / it':>12}")
    for name, row in rows.items():
        ratio = rows["pagoda"]["output_tok_s"] / row["output_tok_s"]
        print(
            f"  {name:34} {row['output_tok_s']:10.1f} {row['ttft_p50_ms']:10.0f} {row['tpot_p50_ms']:10.1f} "
            f"{row['failed']:7d} {ratio:11.2f}x"
        )


if __name__ == "__main__":
    main()
