#!/usr/bin/env bash
# The GPU check, run on a machine with an NVIDIA GPU (docs/gpu.md): Triton kernel tests
# compiled for the GPU, kernel timings against torch and the copy-bandwidth roofline, the quantized
# and FP8 GEMMs' tests and timings (Llama-3-8B linears against bf16 F.linear and the weight-read bound), the
# fused MoE's tests and its Triton kernel against the torch reference at Qwen3-30B-A3B's shapes, greedy
# tokens (CUDA graphs = eager = torch-reference kernels), offline throughput of a random-weight
# Llama-3-8B-shaped model in bf16 with graphs on and off, batch-1 decode against the weight-bytes bound, and
# what broadcasting each step's inputs to tensor/pipeline-parallel workers adds per step (one GPU: TP=1 with a
# reader that only decodes the steps).
# Ends with a short table. Results (JSON) go to $OUT (default /tmp/pagoda-gpu-check).
#
#   bash benchmarks/gpu_check.sh                        # every step (timeouts add up to 19.5 min)
#   bash benchmarks/gpu_check.sh tests kernels tokens   # some steps: tests kernels quantized moe tokens throughput broadcast
#
# Not yet run on a GPU. The device tool allows 10 minutes per command: run it as commands with the same
# OUT, `tests kernels quantized` (timeouts 8 min), `moe` (3.5 min), then `tokens throughput broadcast` (8 min);
# the summary reads whatever is there. The timeouts are upper bounds: a session with less device time left
# runs the steps it needs first. Without a GPU, `tests kernels quantized` run on the CPU (Triton through its
# interpreter, SmolLM2's shapes in the timings), and `moe` with TRITON_INTERPRET=1 at a tiny shape: that is
# how those steps are checked off the GPU.
#
# pyzmq and msgspec are not on that machine: carry them as wheels in .whl/ (see docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagoda-gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

STEPS=${*:-tests kernels quantized moe tokens throughput broadcast}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "== $1"; }
if wanted tests; then
    step "kernel tests on the GPU"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_attention.py \
        tests/kernels/test_triton_layers.py tests/kernels/test_varlen_attention.py tests/kernels/test_gated_delta.py \
        2>&1 | tail -5
    echo "tests exit $?" >"$OUT/tests.txt"
fi
if wanted kernels; then
    step "kernel timings"
    timeout 90 python3 -m benchmarks.kernel_ops --only ops --json "$OUT/kernels.json"
fi
if wanted quantized; then
    step "quantized GEMM: tests on the GPU, then Llama-3-8B linears against bf16 F.linear and the weight-read bound"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_quantized.py \
        tests/kernels/test_fp8_linear.py 2>&1 | tail -5
    echo "quantized tests exit $?" >"$OUT/tests_quantized.txt"
    timeout 90 python3 -m benchmarks.kernel_ops --only quantized --json "$OUT/quantized.json"
fi
if wanted moe; then
    step "fused MoE: tests on the GPU, then Triton against the torch reference (Qwen3-30B-A3B's shapes, bf16)"
    # (-m "not slow": the sm_90 compile check needs no GPU and runs with the CPU suite)
    timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m "not slow" tests/kernels/test_triton_moe.py 2>&1 | tail -5
    echo "moe tests exit $?" >"$OUT/tests_moe.txt"
    timeout 90 python3 -m benchmarks.kernel_ops --only moe --json "$OUT/moe.json"
fi
if wanted tokens; then
    step "greedy tokens: graphs, eager, torch reference (SmolLM2-135M shape, random weights, fp32)"
    timeout 60 python3 -m benchmarks.gpu_engine tokens --path graphs --json "$OUT/tokens_graphs.json"
    timeout 60 python3 -m benchmarks.gpu_engine tokens --path eager --json "$OUT/tokens_eager.json"
    timeout 60 python3 -m benchmarks.gpu_engine tokens --path reference \
        --json "$OUT/tokens_reference.json"
fi
if wanted throughput; then
    step "offline throughput, Llama-3-8B shape, bf16: 64 x 256 -> 128, max 64 running"
    args=(--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64)
    timeout 90 python3 -m benchmarks.gpu_engine throughput "${args[@]}" --json "$OUT/throughput_graphs.json"
    timeout 90 python3 -m benchmarks.gpu_engine throughput "${args[@]}" --enforce-eager \
        --json "$OUT/throughput_eager.json"
fi
if wanted broadcast; then
    step "step broadcast: decode steps (Llama-3-8B shape, bf16, batch 64, graphs) with and without the TP/PP ring"
    timeout 120 python3 -m benchmarks.gpu_engine broadcast --num-prompts 64 --input-len 128 --output-len 64 \
        --json "$OUT/broadcast.json"
fi

step "summary"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None
for name in ("tests.txt", "tests_quantized.txt", "tests_moe.txt"):
    if (out / name).exists():
        print((out / name).read_text().strip())
kern = load("kernels.json")
if kern:
    print(f"copy bandwidth {kern['copy_gb_s']:.0f} GB/s")
    for r in kern["rows"]:
        print(f"  {r['kernel']:<24} {r['shape']:<34} {r['ours_ms']:8.3f} ms  {r['speedup']:5.2f}x torch  "
              f"{r['pct_copy_bw']:4.0f}% of copy bw")
quant = load("quantized.json")
if quant:
    print(f"quantized_linear ({quant['dtype']}): time, F.linear's time / ours, ours / weight-read bound "
          f"(packed bytes / {quant['copy_gb_s']:.0f} GB/s)")
    for r in quant["quantized"]:
        shape = f"{r['in_features']}->{r['out_features']}"
        print(f"  {r['layer']:<8} {shape:<11} M={r['rows']:<4} {r['format']:<16} {r['ours_ms']:8.3f} ms  "
              f"{r['vs_dense']:5.2f}x dense  {r['x_bound']:5.2f}x bound")
moe = load("moe.json")
if moe and moe["moe"]:
    r0 = moe["moe"][0]
    print(f"fused_moe (hidden {r0['hidden']}, {r0['experts']} experts of {r0['inter']}, top-{r0['top_k']}, "
          f"{moe['dtype']}): errors against float32, Triton and torch-reference times, CUDA graph replay")
    for r in moe["moe"]:
        print(f"  {r['tokens']:>4} tokens  err triton {r['triton_err']:.2e} ref {r['ref_err']:.2e} "
              f"(max |out| {r['max_abs']:.2f})  {r['triton_ms']:7.3f} ms vs {r['ref_ms']:7.3f} ms  "
              f"graph {r['graph_ms']:7.3f} ms, equal {r['graph_equal']}  {r['x_bound']:5.2f}x bound")
toks = {p: load(f"tokens_{p}.json") for p in ("graphs", "eager", "reference")}
def same(a, b):
    if not (toks[a] and toks[b]):
        return "missing"
    pairs = [(x, y) for s, t in zip(toks[a]["tokens"], toks[b]["tokens"]) for x, y in zip(s, t)]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)} tokens equal"
print(f"greedy graphs vs eager: {same('graphs', 'eager')}; graphs vs torch reference: {same('graphs', 'reference')}")
for mode in ("graphs", "eager"):
    t = load(f"throughput_{mode}.json")
    if t:
        b = t["batch"]
        bound_ms = t["weight_bytes"] / (kern["copy_gb_s"] * 1e9) * 1e3 if kern else float("nan")
        tpot = t["single_stream_s_per_token"] * 1e3
        print(f"{mode:<7} batch {b['requests']}x{b['input_len']}->{b['output_len']}: {b['output_tok_s']:8.0f} out tok/s, "
              f"{b['total_tok_s']:8.0f} total tok/s; batch-1 decode {tpot:.2f} ms/token = "
              f"{tpot / bound_ms:.2f}x the weight-bytes bound ({bound_ms:.2f} ms)")
cast = load("broadcast.json")
if cast:
    print(f"step broadcast, batch {cast['batch']} decode: {cast['plain_ms_per_step']:.2f} ms/step plain, "
          f"{cast['ring_ms_per_step']:.2f} ms/step with the ring: {cast['overhead_us_per_step']:.0f} us per step")
PY
