"""Quantized models on the CPU, against fp32 in the same run: the kernels behind `--quantization
int8|int4`, and the whole engine (with llama.cpp beside it where llama-cpp-python runs).

    python -m benchmarks.quantization kernels                # SmolLM2-135M's linear shapes, 1/16/128 rows
    python -m benchmarks.quantization kernels --rows 1 4 16  # other row counts
    python -m benchmarks.quantization kernels --no-int8-activations   # float activations at every row count
    python -m benchmarks.quantization kernels --json out.json
    python -m benchmarks.quantization engine --llama-cpp-python .venv-llamacpp/bin/python
    python -m benchmarks.quantization engine --llama-cpp-python .venv-llamacpp/bin/python --q4-k-m

`engine` runs the offline engine on SmolLM2 in fp32, `--quantization int8`, `int4` and its Q4_1 GGUF
served directly: weight memory, one stream's decode speed (512-token prompt, 256 greedy tokens:
255 / (time for 256 - time for 1)), its time to first token (the time for 1, offline: the prefill) and
16 concurrent 128 -> 128 streams' output tok/s; llama.cpp decodes the same Q4_1 file and the fp32 weights
with the same prompt (n_threads as --threads).

`kernels` times, for each linear shape of one SmolLM2 layer and its LM head:
- fp32: the engine's own `Linear` with its weight packed by oneDNN (`pack_for_cpu`), what an unquantized
  model runs;
- C int8 / C int4: `ops.quantized_linear` on weights quantized the way `--quantization int8|int4`
  does at load (int8 per channel symmetric; int4 groups of 32 with scale and min); the path the
  kernel takes is printed at the end of the row (fused / batch / int8 activations / tiles, see
  kernels/cpu/quantized_matmul.py);
- torch int8 / torch int4: torch's own `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` on the same
  integers, where this torch build runs them.
Each time is the median of many calls, all in one run (the ratios compare within it: the machine is
shared and absolute numbers move by ~10 %). The `model/token` line adds one layer's four linears x the
layer count and the LM head: the linear time of one decode step (rows = sequences in the batch).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.quantization.at_load import INT4_GROUP_SIZE, quantize_int4_grouped, quantize_int8_per_channel
from pagoda.engine_core.quantization.base import QuantizedShard, pack_shards
from pagoda.kernels import cpu, ops

# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64, tied LM head of 49152 rows.
LAYERS = 30
SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
PER_LAYER = ("qkv", "o", "gate_up", "down")


def timed(fn: Callable[[], object], min_seconds: float = 0.4, repeats: int = 5) -> float:
    """Median seconds per call: `repeats` batches, each long enough to fill min_seconds / repeats."""
    fn(), fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(min_seconds / repeats / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


Kernel = Callable[[torch.Tensor], torch.Tensor]


def _fp32(weight: torch.Tensor) -> Kernel:
    n, k = weight.shape
    layer = Linear(k, n, dtype=torch.float32)
    layer.weight.data.copy_(weight)
    layer.pack_for_cpu()
    return layer


def _quantized(shard: QuantizedShard) -> Kernel:
    packed = pack_shards("bench", [shard])
    return lambda x: ops.quantized_linear(x, packed)


def _c_path(bits: int, n: int, k: int, rows: int) -> str:
    """The C kernel's path for this shape (cpu.path), as printed after its time."""
    if not cpu.available():
        return "torch reference"
    weight = torch.zeros(n, k)
    shard = quantize_int8_per_channel(weight) if bits == 8 else quantize_int4_grouped(weight, INT4_GROUP_SIZE)
    return cpu.path(cpu.load(), rows, pack_shards("path", [shard]))


def _torch_int8(shard: QuantizedShard) -> Kernel | None:
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return None
    weight = (shard.q - 128).to(torch.int8).contiguous()
    scales = shard.scales.reshape(-1).contiguous()
    return lambda x: op(x, weight, scales)


def _torch_int4(shard: QuantizedShard) -> Kernel | None:
    """torch's layout: w = (q - 8) * scale + zero, qScaleAndZeros [groups, N, 2]."""
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if convert is None or op is None or shard.mins is None:
        return None
    packed = convert(shard.q.to(torch.int32).contiguous(), 1)
    scales = shard.scales.float()
    zeros = shard.mins.float() + 8.0 * scales
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    return lambda x: op(x, packed, shard.group_size, scales_and_zeros)


METHODS: dict[str, Callable[[torch.Tensor, QuantizedShard, QuantizedShard], Kernel | None]] = {
    "fp32": lambda w, int8, int4: _fp32(w),
    "C int8": lambda w, int8, int4: _quantized(int8),
    "C int4": lambda w, int8, int4: _quantized(int4),
    "torch int8": lambda w, int8, int4: _torch_int8(int8),
    "torch int4": lambda w, int8, int4: _torch_int4(int4),
}
WEIGHT_BYTES = {"fp32": 4.0, "C int8": 1.0, "C int4": 0.5, "torch int8": 1.0, "torch int4": 0.5}


def _cycling(build: Callable[[], Kernel | None], weight_bytes: float, working_set: int) -> Kernel | None:
    """Copies of one kernel's weight, called in turn, enough of them that their bytes exceed
    `working_set`: as in a decode step, whose ~30 layers of weights stream through the last-level cache,
    no call finds its weight already cached (one layer's fp32 weights alone would fit in this machine's
    32 MiB L3 and time as if read from it)."""
    first = build()
    if first is None:
        return None
    copies = [first] + [build() for _ in range(max(0, int(working_set / max(weight_bytes, 1.0)) - 1))]
    turn = itertools.cycle(copies)
    return lambda x: next(turn)(x)


def bench_kernels(rows_list: list[int], threads: int, min_seconds: float, working_set: int) -> list[dict]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k) * k**-0.5
        int8 = quantize_int8_per_channel(weight)
        int4 = quantize_int4_grouped(weight, INT4_GROUP_SIZE)
        fns = {
            method: _cycling(functools.partial(build, weight, int8, int4), WEIGHT_BYTES[method] * n * k, working_set)
            for method, build in METHODS.items()
        }
        for rows in rows_list:
            x = torch.randn(rows, k)
            times = {}
            with torch.inference_mode():
                for method, fn in fns.items():
                    if fn is not None and _runs(fn, x):
                        times[method] = timed(functools.partial(fn, x), min_seconds)
            paths = {"C int8": _c_path(8, n, k, rows), "C int4": _c_path(4, n, k, rows)}
            results.append({"shape": name, "n": n, "k": k, "rows": rows, "seconds": times, "paths": paths})
            print(_row(name, n, k, rows, times), " ".join(f"{m}: {p}" for m, p in paths.items()), flush=True)
        del fns
    for rows in rows_list:
        by_shape = {r["shape"]: r["seconds"] for r in results if r["rows"] == rows}
        total = {
            method: LAYERS * sum(by_shape[s][method] for s in PER_LAYER) + by_shape["lm_head"][method]
            for method in METHODS
            if all(method in by_shape[s] for s in SHAPES)
        }
        print(_row("model/token", 0, 0, rows, total), flush=True)
        results.append({"shape": "model/token", "rows": rows, "seconds": total})
    return results


def _runs(fn: Kernel, x: torch.Tensor) -> bool:
    """Whether this torch build runs the op on this input (torch's own kernels refuse some shapes)."""
    try:
        fn(x)
    except RuntimeError:
        return False
    return True


def _row(name: str, n: int, k: int, rows: int, times: dict[str, float]) -> str:
    shape = f"{k}->{n}" if n else f"{LAYERS}x layer + head"
    cells = []
    for method in METHODS:
        if method not in times:
            cells.append(f"{'-':>19}")
            continue
        ms = times[method] * 1e3
        ratio = times["fp32"] / times[method] if "fp32" in times else float("nan")
        cells.append(f"{ms:9.3f} ms {ratio:5.2f}x")
    return f"{name:>11} {shape:>18} M={rows:<5}" + " ".join(cells)


def bench_engine(
    threads: int, repeats: int, int8_activations: bool, llama_python: str | None, q4_k_m: bool = False
) -> list[dict]:
    """Per configuration: weight memory, one-stream decode tok/s, 16-stream output tok/s (best of
    `repeats`), printed with ratios against fp32 from this run."""
    import gc
    import random

    from pagoda.engine_core.default_model import ensure_default_gguf, ensure_default_model
    from pagoda.engine_core.llm import LLM
    from pagoda.engine_core.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    rng = random.Random(0)
    single = [rng.randrange(100, 40000) for _ in range(512)]
    batch = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(16)]
    model_dir, gguf = str(ensure_default_model()), str(ensure_default_gguf())
    configs = [
        ("fp32", {"model": model_dir}),
        ("int8", {"model": model_dir, "quantization": "int8"}),
        ("int4", {"model": model_dir, "quantization": "int4"}),
        ("Q4_1 GGUF", {"model": gguf}),
    ]
    ggufs = [("Q4_1", gguf)]
    if q4_k_m:
        if not llama_python:
            raise SystemExit("--q4-k-m needs --llama-cpp-python: llama.cpp's quantizer writes the file")
        ggufs.append(("Q4_K_M", _q4_k_m_file(llama_python, gguf)))
        configs.append(("Q4_K_M GGUF", {"model": ggufs[-1][1]}))
    rows = []
    for label, kwargs in configs:
        llm = LLM(enable_prefix_caching=False, num_kv_blocks=1024, int8_activations=int8_activations, **kwargs)

        def run(prompts: list[list[int]], tokens: int, llm=llm) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return time.perf_counter() - start

        run([single], 8)  # warm-up
        decode = max(255 / (run([single], 256) - run([single], 1)) for _ in range(repeats))
        first = min(run([single], 1) for _ in range(repeats))  # (the 512-token prompt's prefill and one token)
        concurrent = max(16 * 128 / run(batch, 128) for _ in range(repeats))
        rows.append({"config": label, "weights_mib": llm.engine.runner.weight_bytes / 2**20,
                     "decode_tok_s": decode, "ttft_ms": first * 1e3, "c16_tok_s": concurrent})  # fmt: skip
        del llm
        gc.collect()
    if llama_python:
        for label, path in ggufs:
            rows.append(
                {"config": f"llama.cpp {label}", **_llama_cpp_decode(llama_python, path, single, threads, repeats)}
            )
    base = rows[0]
    print(
        f"{'config':>15} {'weights MiB':>12} {'decode tok/s':>13} {'vs fp32':>8} {'TTFT ms':>8} {'vs fp32':>8} "
        f"{'c16 tok/s':>10} {'vs fp32':>8}"
    )
    for row in rows:
        c16, ttft = row.get("c16_tok_s"), row.get("ttft_ms")
        print(
            f"{row['config']:>15} {row.get('weights_mib', float('nan')):>12.1f} {row['decode_tok_s']:>13.1f} "
            f"{row['decode_tok_s'] / base['decode_tok_s']:>7.2f}x "
            + (f"{ttft:>8.1f} {ttft / base['ttft_ms']:>7.2f}x " if ttft else f"{'-':>8} {'':>8} ")
            + (f"{c16:>10.1f} {c16 / base['c16_tok_s']:>7.2f}x" if c16 else f"{'-':>10} {'':>8}")
        )
    return rows


_LLAMA_CPP_DECODE = """
import json, sys, time
from llama_cpp import Llama
args = json.loads(sys.stdin.read())
llm = Llama(model_path=args["path"], n_ctx=1024, n_threads=args["threads"], n_batch=512, verbose=False)
def run(tokens):
    llm.reset()
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(args["prompt"], temp=0.0, reset=True)):
        if i + 1 == tokens:
            break
    return time.perf_counter() - start
run(8)
print(json.dumps(max(255 / (run(256) - run(1)) for _ in range(args["repeats"]))))
"""


_LLAMA_CPP_QUANTIZE = """
import json, sys
import llama_cpp
args = json.loads(sys.stdin.read())
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.allow_requantize = True
if llama_cpp.llama_model_quantize(args["source"].encode(), args["target"].encode(), params) != 0:
    raise SystemExit("llama_model_quantize failed")
"""


def _q4_k_m_file(python: str, source: str) -> str:
    """SmolLM2 as llama.cpp's quantizer writes a Q4_K_M file (Q4_K with Q6_K for some tensors, as hubs
    publish them), requantized from the default Q4_1 file (its weights are all there is here; the speed
    does not depend on where the values came from). Kept beside the source."""
    import subprocess

    target = Path(source).with_name(Path(source).stem + ".Q4_K_M-requantized.gguf")
    if not target.exists():
        staging = target.with_suffix(".partial")
        payload = json.dumps({"source": source, "target": str(staging)})
        subprocess.run([python, "-c", _LLAMA_CPP_QUANTIZE], input=payload, capture_output=True, text=True, check=True)
        staging.rename(target)
    return str(target)


def _llama_cpp_decode(python: str, path: str, prompt: list[int], threads: int, repeats: int) -> dict:
    """llama.cpp's one-stream decode tok/s on the same prompt, measured like ours (in its own venv)."""
    import subprocess

    payload = json.dumps({"path": path, "prompt": prompt, "threads": threads, "repeats": repeats})
    done = subprocess.run([python, "-c", _LLAMA_CPP_DECODE], input=payload, capture_output=True, text=True, check=True)
    return {"decode_tok_s": float(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    kern = sub.add_parser("kernels", help="linear kernels on SmolLM2's shapes: fp32 vs int8/int4")
    kern.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    kern.add_argument("--threads", type=int, default=2)
    kern.add_argument("--seconds", type=float, default=0.4, help="timing budget per measurement")
    kern.add_argument(
        "--working-set", type=int, default=256, help="MiB of weight copies each method cycles through (0: one copy)"
    )
    kern.add_argument("--json", type=Path)
    kern.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the kernel's int8-activation path where the CPU has VNNI (default: on, as the engine)",
    )
    eng = sub.add_parser("engine", help="the whole engine: fp32 / int8 / int4 / Q4_1 GGUF (+ llama.cpp)")
    eng.add_argument("--threads", type=int, default=2)
    eng.add_argument("--repeats", type=int, default=2)
    eng.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="int8 activations where the CPU has VNNI (default: on, the engine's default)",
    )
    eng.add_argument("--llama-cpp-python", metavar="PYTHON", help="an interpreter that can import llama_cpp")
    eng.add_argument(
        "--q4-k-m", action="store_true", help="also a Q4_K_M file written by llama.cpp's quantizer (needs the above)"
    )
    eng.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "engine":
        results = bench_engine(args.threads, args.repeats, args.int8_activations, args.llama_cpp_python, args.q4_k_m)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    if args.command == "kernels":
        cpu.settings.int8_activations = args.int8_activations
        header = " ".join(f"{m + ' (vs fp32)':>19}" for m in METHODS)
        print(f"{'linear':>11} {'K->N':>18} {'rows':<7}{header}  ({args.threads} threads, medians)")
        results = bench_kernels(args.rows, args.threads, args.seconds, args.working_set << 20)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
