"""Parallel execution, each case against its baseline in the same run.

  tp   tensor parallel on the CPU: TP=2 (two processes, one core each, gloo) vs TP=1 (one process, two
       threads; and one thread, for reference), the default model (SmolLM2-135M, float32):
       single-stream decode tok/s of one request (128-token prompt, 128 greedy tokens, in-process
       `EngineCore`, after a warm-up), and the time rank 0 spends in collectives per decode step (per
       layer one all-reduce after attention and one after the MLP, one for the embedding, one gather of
       the logits), which includes waiting for the other rank.

The cases alternate (A B A B ...) over --repeats rounds so that load from other programs on the
machine hits both alike; every round's ratio is printed, then the medians.

    python -m benchmarks.parallel tp --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.sampling_params import SamplingParams

# case -> (tensor_parallel_size, torch threads per rank; None: the rank's share of the cores, here one)
CASES = {"TP=1 x 2 threads": (1, 2), "TP=2 x 1 core": (2, None), "TP=1 x 1 thread": (1, 1)}


def decode_run(tp: int, threads: int | None, prompt_tokens: int, new_tokens: int) -> dict:
    """One fresh engine: decode speed of a single request, and rank 0's collective time per step."""
    engine = EngineCore(EngineConfig(tensor_parallel_size=tp, num_threads=threads, kv_cache_memory=256 * 2**20))
    try:
        engine.warm_up()
        prompt = [(17 * i) % 4000 + 100 for i in range(prompt_tokens)]
        engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill, and the first token
        group = engine.runner.tp
        group.timing, group.collective_seconds, group.collective_calls = True, 0.0, 0
        steps = 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - started
        return {
            "tok_s": steps / elapsed,
            "step_ms": 1000 * elapsed / steps,
            "collective_ms": 1000 * group.collective_seconds / steps,
            "collectives": group.collective_calls / steps,
        }
    finally:
        engine.close()


def bench_tp(args) -> None:
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    baseline, parallel, single = CASES
    for round_ in range(args.repeats):
        for name, (tp, threads) in CASES.items():
            runs[name].append(decode_run(tp, threads, args.prompt_tokens, args.new_tokens))
        speeds = ", ".join(f"{name} {runs[name][-1]['tok_s']:.1f}" for name in CASES)
        ratio = runs[parallel][-1]["tok_s"] / runs[baseline][-1]["tok_s"]
        print(f"  round {round_ + 1}: tok/s {speeds}; TP=2 / TP=1 x 2 threads {ratio:.2f}", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    print(f"\nSingle-stream decode, {args.prompt_tokens}-token prompt -> {args.new_tokens} tokens, medians:")
    print(f"  {'':30}" + "".join(f"{name:>18}" for name in CASES))
    print(f"  {'decode tok/s':30}" + "".join(f"{median(name, 'tok_s'):18.1f}" for name in CASES))
    print(f"  {'ms per step':30}" + "".join(f"{median(name, 'step_ms'):18.2f}" for name in CASES))
    print(f"  {'TP=2 / TP=1 x 2 threads':30}{median(parallel, 'tok_s') / median(baseline, 'tok_s'):36.2f}")
    print(f"  {'TP=2 / TP=1 x 1 thread':30}{median(parallel, 'tok_s') / median(single, 'tok_s'):36.2f}")
    collective_ms = median(parallel, "collective_ms")
    print(
        f"  TP=2, rank 0: {median(parallel, 'collectives'):.0f} collectives per step, {collective_ms:.2f} ms "
        f"({collective_ms / median(parallel, 'step_ms'):.0%} of the step)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = parser.add_subparsers(dest="case", required=True)
    tp = cases.add_parser("tp", help="tensor parallel: TP=2 x 1 core vs TP=1 x 2 threads, single-stream decode")
    tp.add_argument("--repeats", type=int, default=3)
    tp.add_argument("--prompt-tokens", type=int, default=128)
    tp.add_argument("--new-tokens", type=int, default=128)
    tp.set_defaults(run=bench_tp)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
