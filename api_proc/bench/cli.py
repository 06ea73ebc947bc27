"""The `pagoda bench` subcommands."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict

from pagoda.api_proc.bench import vllm_compat
from pagoda.engine_core.config import add_engine_args


def _add_dataset_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "sharegpt", "prefix"],
        help="random token ids of exact lengths; ShareGPT conversations; a shared prefix",
    )
    g.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON file (default: the bundled synthetic ShareGPT-like set)"
    )
    g.add_argument("--num-prompts", type=int, default=100, help="number of requests")
    g.add_argument("--input-len", type=int, default=128, help="random/prefix: prompt tokens (unique part)")
    g.add_argument("--output-len", type=int, default=128, help="random/prefix: tokens to generate")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens every request shares")
    g.add_argument(
        "--tokenizer", default=None, help="HF tokenizer directory, to count text prompts exactly and make text for chat"
    )
    vllm_compat.add_dataset_aliases(g)
    if with_seed:  # offline commands have the engine's --seed, which seeds the dataset too
        g.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times")


def load_dataset(args, tokenizer=None):
    from pagoda.api_proc.bench import datasets

    if args.dataset_name == "random" and args.random_prefix_len:  # vLLM's random dataset with a shared prefix
        return datasets.prefix_requests(
            args.num_prompts, args.random_prefix_len, args.input_len, args.output_len, args.seed
        )
    if args.dataset_name == "random":
        return datasets.random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    if args.dataset_name == "prefix":
        return datasets.prefix_requests(args.num_prompts, args.prefix_len, args.input_len, args.output_len, args.seed)
    if args.dataset_path:
        return datasets.sharegpt_file(args.dataset_path, args.num_prompts, args.seed, tokenizer)
    return datasets.synthetic_sharegpt(args.num_prompts, args.seed, tokenizer)


def _tokenizer(args):
    if not args.tokenizer:
        return None
    from pagoda.engine_core.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagoda.api_proc.bench.datasets import as_text
    from pagoda.api_proc.bench.metrics import format_report, parse_goodput, summarize
    from pagoda.api_proc.bench.runner import run_serve, save_result

    vllm_compat.resolve(args)
    slo = parse_goodput(args.goodput)
    tokenizer = _tokenizer(args)
    requests = load_dataset(args, tokenizer)
    if args.endpoint == "chat":
        requests = as_text(requests, tokenizer)
    rate = math.inf if args.request_rate in ("inf", "Infinity") else float(args.request_rate)
    results, duration, model = asyncio.run(
        run_serve(
            args.base_url,
            requests,
            endpoint=args.endpoint,
            model=args.model,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            ignore_eos=not args.no_ignore_eos,
            temperature=args.temperature,
            api_key=args.api_key,
            seed=args.seed,
            progress=not args.no_progress,
        )
    )
    summary = summarize(results, duration, slo)
    print(format_report(summary, f"Serving Benchmark Result ({model})"))
    errors = sorted({r.error for r in results if not r.success})
    for error in errors[:5]:
        print(f"failure: {error}")
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    path = vllm_compat.result_path(args, model)
    if path is not None:
        save_result(path, summary, settings, results, vllm_compat.flat_keys(summary, results, args, model))
    if args.plot:
        from pagoda.api_proc.bench.plot import plot_run

        plot_run(
            results,
            duration,
            args.plot,
            f"{model}: {args.dataset_name}, rate {args.request_rate}, "
            f"concurrency {args.max_concurrency or 'unlimited'}",
        )
    return 0


def _offline_llm(args: argparse.Namespace):
    from pagoda.engine_core.config import engine_config_from_args
    from pagoda.engine_core.llm import LLM

    return LLM(**asdict(engine_config_from_args(args)))


def _save_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pagoda.api_proc.bench.offline import run_throughput

    llm = _offline_llm(args)
    result = run_throughput(llm, load_dataset(args, llm.tokenizer), ignore_eos=not args.no_ignore_eos)
    print(
        f"Throughput: {result['request_throughput']:.2f} requests/s, {result['total_throughput']:.1f} total "
        f"tokens/s, {result['output_throughput']:.1f} output tokens/s ({result['elapsed_s']:.1f} s)"
    )
    _save_json(args.save_result, result)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from pagoda.api_proc.bench.offline import run_latency

    result = run_latency(
        _offline_llm(args),
        args.batch_size,
        args.input_len,
        args.output_len,
        args.num_iters,
        args.num_iters_warmup,
        args.seed,
    )
    print(
        f"Batch of {args.batch_size} x {args.input_len} -> {args.output_len} tokens: mean {result['mean_s']:.3f} s, "
        f"median {result['median_s']:.3f} s, p90 {result['p90_s']:.3f} s, p99 {result['p99_s']:.3f} s"
    )
    _save_json(args.save_result, result)
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: serve (any OpenAI-compatible server), throughput, latency")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="drive a running OpenAI-compatible server and report TTFT/TPOT/ITL")
    serve.add_argument(
        "--base-url", default=None, help="server address (with or without /v1); default http://127.0.0.1:8000"
    )
    serve.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    serve.add_argument(
        "--endpoint",
        type=vllm_compat.endpoint,
        default=None,
        help="completions (default) or chat; vLLM's /v1/completions and /v1/chat/completions too",
    )
    serve.add_argument("--request-rate", default="inf", help="requests per second, or inf for all at once")
    serve.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier",
    )
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: ignore_eos, so outputs have the asked length)",
    )
    serve.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    serve.add_argument(
        "--goodput",
        nargs="*",
        default=None,
        metavar="KEY:MS",
        help="service-level objectives for goodput, e.g. ttft:500 tpot:100 e2el:5000",
    )
    serve.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.json",
        help="summary + every request's timings (and vLLM's flat keys); alone, a switch as in vLLM "
        "(--result-dir, --result-filename)",
    )
    serve.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs, tokens/s and concurrency")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_dataset_args(serve)
    vllm_compat.add_serve_aliases(serve)
    serve.set_defaults(func=cmd_bench_serve)

    throughput = kinds.add_parser("throughput", help="offline throughput of the engine in this process")
    _add_dataset_args(throughput, with_seed=False)
    throughput.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    throughput.add_argument("--save-result", default=None, metavar="FILE.json")
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)

    latency = kinds.add_parser("latency", help="end-to-end latency of one batch, in this process")
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--input-len", type=int, default=128)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters", type=int, default=5)
    latency.add_argument("--num-iters-warmup", type=int, default=1)
    latency.add_argument("--save-result", default=None, metavar="FILE.json")
    add_engine_args(latency)
    latency.set_defaults(func=cmd_bench_latency)
