"""The `pagoda` command: `pagoda generate`, `pagoda download-default`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict

from engine_core.lifecycle import configure_logging


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that build an EngineConfig; shared by every command that runs an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or hub id (default: SmolLM2-135M-Instruct, prepared on first use)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype; auto = float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="memory for the KV cache pool, e.g. 2GiB, 512MiB (default: 2GiB on CPU; on CUDA what "
                        "--gpu-memory-utilization leaves after weights, the profiled activation peak and graphs)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the GPU's memory this server may use in all, KV cache included")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy = random weights of the model's shape, no checkpoint needed (benchmarks)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (longer prompts are prefilled in chunks)")
    g.add_argument("--max-joint-prefill-tokens", type=int, default=256,
                   help="a lone prompt may use the whole step budget; several prompts share a step only up to "
                        "this many prefill tokens (lower = first tokens sooner when many requests arrive at once)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off (on by default)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's max_position_embeddings)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")


def engine_config_from_args(args: argparse.Namespace):
    from engine_core.config import EngineConfig, parse_size

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                        load_format=args.load_format,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_joint_prefill_tokens=args.max_joint_prefill_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, num_threads=args.num_threads)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    started = time.monotonic()
    llm = LLM(**asdict(engine_config_from_args(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    print(completion.text)
    logging.getLogger("pagoda").info("%d tokens, finish_reason=%s, %.1fs since launch",
                                     len(completion.token_ids), completion.finish_reason,
                                     time.monotonic() - started)
    return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    g.add_argument("--port", type=int, default=8000, help="port the HTTP API listens on")
    g.add_argument("--api-workers", type=int, default=1,
                   help="HTTP worker processes sharing the port (SO_REUSEPORT)")
    g.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; default: the model argument)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM/SIGINT waits for in-flight requests before ending them")
    g.add_argument("--engine-stall-timeout", type=float, default=30.0,
                   help="/health turns 503 when the engine loop has made no progress for this long")
    g.add_argument("--frontend", default=None,
                   help="extra address for direct clients: ipc:///path.sock, or tcp://host:port (needs --curve-keys)")
    g.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="CURVE certificates for a tcp:// frontend, as written by `pagoda keys DIR`")
    from api_proc.serve_settings import add_limit_args

    add_limit_args(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from api_proc.launcher import serve

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ValueError("give the model once: as the MODEL argument or as --model")
        args.model = args.model_arg
    if args.api_workers < 1:
        raise ValueError("--api-workers must be at least 1")
    return serve(args)


def cmd_keys(args: argparse.Namespace) -> int:
    from engine_core.zmq_security import generate_keys

    for name, path in generate_keys(args.directory).items():
        print(f"{name}: {path}")
    return 0


def cmd_download_default(args: argparse.Namespace) -> int:
    from engine_core.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object per line (every process)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt with the offline engine")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (a user message)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (and the direct-client socket)")
    srv.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                     help="Hugging Face model directory or hub id (same as --model; default: SmolLM2-135M-Instruct)")
    srv.add_argument("--config", metavar="FILE",
                     help="YAML file of flags (`max-num-seqs: 64`, lists for repeatable flags); the command line wins")
    add_serve_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="write CURVE certificates for a tcp:// frontend (server, client, authorized/)")
    keys.add_argument("directory", help="where to write them (created with mode 0700)")
    keys.set_defaults(func=cmd_keys)

    from api_proc.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)

    dl = sub.add_parser("download-default", help="prepare the default model in the cache and print its path")
    dl.set_defaults(func=cmd_download_default)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine_core.cli_config import parse_args_with_config

    args = parse_args_with_config(build_parser(), argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
