#!/usr/bin/env bash
# The GPU check, for a session lent a GPU machine (README: "Checking on a GPU"): Triton kernel tests
# compiled for the GPU, kernel timings against torch and the copy-bandwidth roofline, greedy tokens
# (CUDA graphs = eager = torch-reference kernels), offline throughput of a random-weight
# Llama-3-8B-shaped model in bf16 with graphs on and off, batch-1 decode against the weight-bytes bound.
# Ends with a short table. Results (JSON) go to $OUT (default /tmp/pagoda-gpu-check).
#
#   bash benchmarks/gpu_check.sh            # about 6-8 minutes on an H200
#
# pyzmq and msgspec are not on that machine: carry them as wheels in .whl/ (see the README).
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

step() { echo; echo "== $1"; }
step "kernel tests on the GPU"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_layers.py 2>&1 | tail -5
echo "tests exit $?" >"$OUT/tests.txt"
step "kernel timings"
timeout 180 python3 benchmarks/kernels.py --json "$OUT/kernels.json"
step "greedy tokens: graphs, eager, torch reference (SmolLM2-135M shape, random weights, fp32)"
timeout 120 python3 benchmarks/gpu_engine.py tokens --path graphs --json "$OUT/tokens_graphs.json"
timeout 120 python3 benchmarks/gpu_engine.py tokens --path eager --json "$OUT/tokens_eager.json"
PAGODA_DISABLE_TRITON=1 timeout 120 python3 benchmarks/gpu_engine.py tokens --path reference \
    --json "$OUT/tokens_reference.json"
step "offline throughput, Llama-3-8B shape, bf16: 128 x 256 -> 256"
timeout 240 python3 benchmarks/gpu_engine.py throughput --json "$OUT/throughput_graphs.json"
timeout 240 python3 benchmarks/gpu_engine.py throughput --enforce-eager --json "$OUT/throughput_eager.json"

step "summary"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None
print((out / "tests.txt").read_text().strip())
kern = load("kernels.json")
if kern:
    print(f"copy bandwidth {kern['copy_gb_s']:.0f} GB/s")
    for r in kern["rows"]:
        print(f"  {r['kernel']:<24} {r['shape']:<34} {r['ours_ms']:8.3f} ms  {r['speedup']:5.2f}x torch  "
              f"{r['pct_copy_bw']:4.0f}% of copy bw")
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
PY
