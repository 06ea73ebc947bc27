"""`vllm bench serve`'s spellings for `pagoda bench serve`, and vLLM's flat keys in the saved JSON, so
scripts and dashboards written for vLLM's benchmark run unchanged against Pagoda.

Flags (each an alias of Pagoda's own, or vLLM's behaviour where Pagoda had none):
  --random-input-len / --random-output-len / --random-range-ratio   = --input-len / --output-len / --range-ratio
  --random-prefix-len N      the random dataset with N shared tokens before each prompt (the prefix dataset)
  --backend openai|vllm|openai-chat   the completions or the chat endpoint
  --endpoint /v1/completions | /v1/chat/completions   (as well as Pagoda's completions | chat)
  --host / --port            the server, when --base-url is not given
  --save-result              a switch as in vLLM (or, as before, --save-result FILE.json)
  --result-dir / --result-filename   where the switch saves (vLLM's default file name otherwise)
  --percentile-metrics ttft,tpot,itl,e2el / --metric-percentiles 99   which flat p<N>_<metric>_ms keys
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np

from pagoda.api_proc.bench.client import RequestResult

BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ENDPOINTS = {
    "completions": "completions",
    "chat": "chat",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def endpoint(value: str) -> str:
    """--endpoint: Pagoda's word or vLLM's path."""
    if value not in ENDPOINTS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ENDPOINTS)}, not {value!r}")
    return ENDPOINTS[value]


def add_serve_aliases(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that `pagoda bench serve` has no own spelling for (the dataset aliases are in
    add_dataset_aliases)."""
    g = parser.add_argument_group("vllm bench serve spellings")
    g.add_argument("--backend", choices=sorted(BACKENDS), default=None, help="openai, vllm: completions; openai-chat")
    g.add_argument("--host", default=None, help="with --port: the server, when --base-url is not given")
    g.add_argument("--port", type=int, default=None)
    g.add_argument("--result-dir", default=None, help="with --save-result: the directory the result goes to")
    g.add_argument("--result-filename", default=None, help="with --save-result: its file name")
    g.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="the metrics whose flat mean/median/std/p<N> keys are saved: ttft, tpot, itl, e2el",
    )
    g.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles of those flat keys (e.g. 25,50,99)"
    )


def add_dataset_aliases(group) -> None:
    """(SUPPRESS: an alias sets its Pagoda flag's value only when given.)"""
    for flag, kind, dest in (
        ("--random-input-len", int, "input_len"),
        ("--random-output-len", int, "output_len"),
        ("--random-range-ratio", float, "range_ratio"),
    ):
        group.add_argument(flag, type=kind, dest=dest, default=argparse.SUPPRESS, help=f"= --{dest.replace('_', '-')}")
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random: this many tokens shared by every prompt before its --input-len random ones",
    )


def resolve(args: argparse.Namespace) -> None:
    """Turn the vLLM spellings into Pagoda's settings (in place), and check them."""
    if args.endpoint is None:
        args.endpoint = BACKENDS[args.backend] if args.backend is not None else "completions"
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            raise SystemExit("pagoda bench serve: give --base-url or --host/--port, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    elif args.base_url is None:
        args.base_url = DEFAULT_BASE_URL
    args.percentile_metrics_list = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = set(args.percentile_metrics_list) - set(METRICS)
    if unknown:
        raise SystemExit(f"pagoda bench serve: --percentile-metrics takes {', '.join(METRICS)}, not {sorted(unknown)}")
    try:
        args.metric_percentiles_list = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        message = f"pagoda bench serve: --metric-percentiles {args.metric_percentiles!r} is not numbers"
        raise SystemExit(message) from None
    if not all(0 < p <= 100 for p in args.metric_percentiles_list):
        raise SystemExit("pagoda bench serve: --metric-percentiles must lie in (0, 100]")


def result_path(args: argparse.Namespace, model: str) -> Path | None:
    """Where --save-result saves: its FILE, or (vLLM's switch) --result-dir / --result-filename, by
    default vLLM's name `<backend>-<rate>qps[-concurrency<N>]-<model>-<YYYYmmdd-HHMMSS>.json`."""
    if args.save_result is None:
        return None
    if args.save_result:
        return Path(args.save_result)
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.backend or 'openai'}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{stamp}.json"
    return Path(args.result_dir or ".") / name


def _percentile_key(p: float) -> str:
    return f"p{int(p)}" if p == int(p) else f"p{p}"


def flat_keys(summary: dict, results: list[RequestResult], args: argparse.Namespace, model: str) -> dict:
    """vLLM's top-level keys of a saved result (milliseconds for latencies, as vLLM)."""
    done = [r for r in results if r.success]
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend or ("openai-chat" if args.endpoint == "chat" else "openai"),
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": summary["duration_s"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "total_input_tokens": summary["input_tokens"],
        "total_output_tokens": summary["output_tokens"],
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary.get("goodput"),
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_throughput"],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itl],
        "e2el": [r.e2el for r in done],
    }
    for metric in args.percentile_metrics_list:
        array = np.asarray(values[metric], dtype=np.float64) * 1000.0
        empty = array.size == 0
        out[f"mean_{metric}_ms"] = 0.0 if empty else float(array.mean())
        out[f"median_{metric}_ms"] = 0.0 if empty else float(np.median(array))
        out[f"std_{metric}_ms"] = 0.0 if empty else float(array.std())
        for p in args.metric_percentiles_list:
            out[f"{_percentile_key(p)}_{metric}_ms"] = 0.0 if empty else float(np.percentile(array, p))
    return out
