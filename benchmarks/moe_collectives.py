"""What combining a mixture-of-experts layer's output costs between two CPU ranks, per call.

Under tensor and expert parallel (engine_core/models/moe.py) attention is split by heads, so every rank
already holds every token: each rank computes its partial sum [T, H] and one all-reduce adds them. This
times that all-reduce on the engine's path (`TPGroup.all_reduce`: shared memory up to 4 MiB, else gloo)
for T = 1, 16, 256 tokens and H = 2048, next to gloo's all-reduce and gloo's all-to-all of the same
tensor (what an all-to-all combine would move at the least, before any dispatch).

Two processes, one core and one torch thread each, as `-tp 2` runs on a two-core machine:

    python -m benchmarks.moe_collectives --iterations 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

HIDDEN = 2048
TOKENS = (1, 16, 256)


def _time(call, iterations: int) -> float:
    """Median seconds of one call, after a warm-up (every rank calls as often: the collectives pair up)."""
    for _ in range(10):
        call()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _rank(rank: int, runtime_dir: str, iterations: int, dtype_name: str, results) -> None:
    from pagoda.engine_core.parallel import shm_allreduce
    from pagoda.engine_core.parallel.distributed import init_groups

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    shm_path = os.path.join(runtime_dir, "allreduce0")
    group, _ = init_groups(rank, 2, 1, os.path.join(runtime_dir, "store"), torch.device("cpu"), shm_paths=[shm_path])
    pg = group._pg
    assert pg is not None and shm_allreduce.supported()
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN).to(dtype)
        out = torch.empty_like(x)
        row = {
            "engine all-reduce": _time(lambda x=x: group.all_reduce(x), iterations),
            "gloo all-reduce": _time(lambda x=x: pg.allreduce([x]).wait(), iterations),
            "gloo all-to-all": _time(lambda x=x, out=out: pg.alltoall_base(out, x, [], []).wait(), iterations),
        }
        if rank == 0:
            results[tokens] = row
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from pagoda.engine_core.parallel import shm_allreduce

    with tempfile.TemporaryDirectory(prefix="pagoda-moe-bench-") as runtime_dir:
        shm_allreduce.create_file(os.path.join(runtime_dir, "allreduce0"), 2)
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank, args=(runtime_dir, args.iterations, args.dtype, results), nprocs=2)
            results = dict(results)
    columns = list(results[TOKENS[0]])
    print(f"[T, {HIDDEN}] {args.dtype}, 2 ranks, median of {args.iterations} calls (microseconds)")
    print("| T | MiB | " + " | ".join(columns) + " |")
    print("|---:|---:|" + "---:|" * len(columns))
    size = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    for tokens, row in results.items():
        cells = " | ".join(f"{row[c] * 1e6:.0f}" for c in columns)
        print(f"| {tokens} | {tokens * HIDDEN * size / 2**20:.3g} | {cells} |")


if __name__ == "__main__":
    main()
