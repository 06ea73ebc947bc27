"""End-to-end engine checks for a GPU: greedy tokens across execution paths, offline throughput with
and without CUDA graphs, batch-1 decode against the weight-bandwidth bound. Random-weight models are
built from a config alone (`load_format="dummy"`), so nothing is downloaded.

    python -m benchmarks.gpu_engine tokens --path graphs     # prints the greedy tokens as JSON
    python -m benchmarks.gpu_engine tokens --path eager      #   (--path reference: torch kernels)
    python -m benchmarks.gpu_engine throughput [--enforce-eager]
    python -m benchmarks.gpu_engine broadcast                # what the TP/PP step broadcast adds per step
    python -m benchmarks.gpu_engine --model-shape tiny ...   # a small model: runs on the CPU too

`benchmarks/gpu_check.sh` runs them all and compares. The `reference` path runs the engine with
PAGODA_DISABLE_TRITON=1 (set here for the engine this process builds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.gpu_memory import device_memory
from pagoda.engine_core.sampling_params import SamplingParams

# Llama-3-8B's shape; SmolLM2-135M's for the token checks (fp32 there: exact comparisons need it).
SHAPES = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


def model_dir(shape: str) -> Path:
    """A directory holding only the config.json of `shape` (written once per temp dir)."""
    path = Path(tempfile.gettempdir()) / f"pagoda-shape-{shape}"
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def engine(args, **overrides) -> EngineCore:
    cfg = dict(
        model=str(model_dir(args.model_shape)),
        load_format="dummy",
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    cfg.update(overrides)
    if cfg.get("device", "auto") == "cpu" or not torch.cuda.is_available():
        cfg.setdefault("num_kv_blocks", 512)
    return EngineCore(EngineConfig(**cfg))


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(f"r{index}", prompt, params)
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    started = time.perf_counter()
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - started


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def cmd_tokens(args) -> dict:
    """Greedy tokens of 8 prompts that stay one decode batch of a captured size from start to end."""
    core = engine(args, enforce_eager=args.path == "eager")
    prompts = random_prompts(8, 40, SHAPES[args.model_shape]["vocab_size"])
    tokens, _ = run(core, prompts, args.max_tokens)
    used, total = device_memory(core.runner.device)  # what EngineReady reports (the web dashboard shows it)
    print(f"device memory held by the engine: {used / 2**30:.2f} GiB of {total / 2**30:.2f} GiB")
    return {"path": args.path, "tokens": tokens, "device_memory_used": used, "device_memory_total": total}


def cmd_throughput(args) -> dict:
    core = engine(args, enforce_eager=args.enforce_eager)
    vocab = SHAPES[args.model_shape]["vocab_size"]
    run(core, random_prompts(2, 16, vocab, seed=1), 4)  # warm-up: first-call compilation stays out
    batch = random_prompts(args.num_prompts, args.input_len, vocab)
    tokens, seconds = run(core, batch, args.output_len)
    generated = sum(map(len, tokens))
    single, single_seconds = run(core, random_prompts(1, 128, vocab, seed=2), args.output_len)
    _first_token, _ = run(core, random_prompts(1, 128, vocab, seed=2), 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    return {
        "graphs": not args.enforce_eager and core.runner.decode_graphs is not None,
        "batch": {
            "requests": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seconds": seconds,
            "output_tok_s": generated / seconds,
            "total_tok_s": (generated + args.num_prompts * args.input_len) / seconds,
        },
        "single_stream_s_per_token": single_seconds / len(single[0]),
        "weight_bytes": weight_bytes,
        "kv_blocks": core.kv_manager.pool.num_usable_blocks,
    }


def _read_steps(spec_bytes: bytes) -> None:
    """A reader of the broadcast ring that decodes every step message, as a worker rank does, and runs
    no model: what rank 0 pays for its workers' inputs, without their compute."""
    import msgspec

    from pagoda.engine_core.parallel import step_message
    from pagoda.engine_core.parallel.shm_ring import RingClosed, RingPeerGone, RingReader, RingSpec

    reader = RingReader(msgspec.msgpack.decode(spec_bytes, type=RingSpec), 0)
    try:
        while step_message.decode(reader.read(timeout_s=600)) != step_message.STOP:
            pass
    except (RingClosed, RingPeerGone):
        pass
    reader.close()


class RingFollowers:
    """The executor's step broadcast (engine_core/parallel/executor.py), to one reader that only decodes."""

    def __init__(self):
        import multiprocessing

        import msgspec

        from pagoda.engine_core.parallel.shm_ring import RingWriter

        self.dir = tempfile.mkdtemp(prefix="pagoda-ring-bench-")
        self.ring = RingWriter(num_readers=1, runtime_dir=self.dir)
        self.reader = multiprocessing.get_context("spawn").Process(
            target=_read_steps, args=(msgspec.msgpack.encode(self.ring.spec),), daemon=True
        )
        self.reader.start()

    def broadcast_step(self, step, rows) -> None:
        from pagoda.engine_core.parallel import step_message

        self.ring.write(step_message.encode_step(step, rows), timeout_s=60)

    def broadcast_head(self) -> None:
        raise AssertionError("no pipeline here")

    def close(self) -> None:
        import shutil

        from pagoda.engine_core.parallel import step_message

        self.ring.write(step_message.encode_stop(), timeout_s=10)
        self.reader.join(10)
        self.ring.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def cmd_broadcast(args) -> dict:
    """Decode steps of a batch with and without the ring broadcast of each step's inputs (alternating
    rounds, the same engine): the overhead the tensor/pipeline-parallel path adds to rank 0 per step."""
    core = engine(args, enforce_eager=args.enforce_eager)
    vocab = SHAPES[args.model_shape]["vocab_size"]
    run(core, random_prompts(2, 16, vocab, seed=1), 4)  # warm-up
    followers = RingFollowers()
    per_step: dict[str, list[float]] = {"plain": [], "ring": []}
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up (the reader process starting)
            for case in ("plain", "ring"):
                core.runner.followers = followers if case == "ring" else None
                params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
                for index, prompt in enumerate(random_prompts(args.num_prompts, args.input_len, vocab)):
                    core.add_request(f"r{index}", prompt, params)
                while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
                    core.step()  # the prefills: not measured
                steps, started = 0, time.perf_counter()
                while core.has_unfinished_requests():
                    core.step()
                    steps += 1
                if round_:
                    per_step[case].append((time.perf_counter() - started) / steps)
    finally:
        core.runner.followers = None
        followers.close()
    plain, ring = (sorted(per_step[c])[len(per_step[c]) // 2] for c in ("plain", "ring"))
    return {
        "batch": args.num_prompts,
        "graphs": core.runner.decode_graphs is not None,
        "plain_ms_per_step": 1000 * plain,
        "ring_ms_per_step": 1000 * ring,
        "overhead_us_per_step": 1e6 * (ring - plain),
        "rounds": per_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["tokens", "throughput", "broadcast"])
    parser.add_argument("--rounds", type=int, default=3, help="broadcast: rounds of each case, alternating")
    parser.add_argument("--model-shape", choices=list(SHAPES), default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--path", choices=["graphs", "eager", "reference"], default="graphs")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.path == "reference":  # the torch kernels: the engine configures its kernels from this
        os.environ["PAGODA_DISABLE_TRITON"] = "1"
    if args.command == "tokens":
        args.model_shape = args.model_shape or "smollm2-135m"
        args.dtype = args.dtype or "float32"
        result = cmd_tokens(args)
    else:
        args.model_shape = args.model_shape or "llama3-8b"
        args.dtype = args.dtype or "auto"
        result = cmd_throughput(args) if args.command == "throughput" else cmd_broadcast(args)
    text = json.dumps(result)
    if args.json:
        args.json.write_text(text)
    print(text if args.command != "tokens" else f"{len(result['tokens'])} sequences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
