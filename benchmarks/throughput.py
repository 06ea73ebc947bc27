"""Offline throughput: Pagoda vs HF transformers `generate` (static batches) in the same run, and
with --vllm VENV vs vLLM's offline `LLM.generate` (a venv made by benchmarks/peers/vllm_cpu.sh).

Workloads (random token-id prompts, ignore_eos so every request generates exactly its output length):
  a       64 requests x 128 prompt tokens -> 128 output tokens
  b       seeded variable-length mix: 64 requests, prompts 32-384 tokens, outputs 16-192
  single  one stream: 512-token prompt, 256 new tokens (decode tok/s after the first token)
  bound   what torch's own matmuls allow for this model here: every projection in its exact shape,
          timed at the batch sizes the workloads use (tokens/s if nothing but matmuls ran)

    python benchmarks/throughput.py                 # everything (HF baselines take ~6 minutes)
    python benchmarks/throughput.py --skip-hf       # Pagoda only
    python benchmarks/throughput.py --only a single
    python benchmarks/throughput.py --skip-hf --only b --vllm /tmp/vllm-peer
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagoda.engine_core.llm import LLM
from pagoda.engine_core.sampling_params import SamplingParams

try:  # run as a module (python -m benchmarks.throughput)
    from benchmarks.offline_timing import timed_generate
except ImportError:  # run as a script: its directory is on the path
    from offline_timing import timed_generate  # type: ignore[no-redef]


def workload_a(seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 49000) for _ in range(128)], 128) for _ in range(64)]


def workload_b(seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 49000) for _ in range(rng.randint(32, 384))], rng.randint(16, 192)) for _ in range(64)]


def run_pagoda(llm: LLM, work) -> dict:
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    return timed_generate(llm, prompts, params, [SamplingParams(temperature=0, max_tokens=4)] * 2, work)


def run_vllm(venv: Path, model_dir: Path, work) -> dict:
    """vLLM's offline LLM.generate on `work`, in its own venv, with the environment vllm_cpu.sh gives
    its server (both cores bound to its OpenMP threads, libiomp5 and tcmalloc preloaded, 4 GiB KV)."""
    preload = [str(venv / "lib" / "libiomp5.so")]
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    if tcmalloc.exists():
        preload.insert(0, str(tcmalloc))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{torch.get_num_threads() - 1}",
        "LD_PRELOAD": ":".join(preload),
    }
    script = Path(__file__).parent / "peers" / "vllm_offline.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(work, f)
        f.flush()
        done = subprocess.run(
            [str(venv / "bin" / "python"), str(script), "--model", str(model_dir), "--workload", f.name],
            env=env,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's offline run failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])


@torch.no_grad()
def run_hf(model, work, batch_size: int) -> dict:
    """Static batches of `batch_size`, left-padded, EOS suppressed until each request's length."""
    start = time.perf_counter()
    out_tokens = 0
    for i in range(0, len(work), batch_size):
        chunk = work[i : i + batch_size]
        longest = max(len(p) for p, _ in chunk)
        max_new = max(n for _, n in chunk)
        ids = torch.full((len(chunk), longest), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, longest - len(p) :] = torch.tensor(p)
            mask[row, longest - len(p) :] = 1
        model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=2
        )
        out_tokens += sum(n for _, n in chunk)  # tokens the workload asked for; extra ones are waste
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tok_s": out_tokens / elapsed}


def single_stream(llm: LLM) -> dict:
    rng = random.Random(1)
    prompt = {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(512)]}
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompt, first, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()  # time the prompt's computation, not a prefix-cache hit
    t0 = time.perf_counter()
    llm.generate(prompt, first, use_tqdm=False)
    ttft = time.perf_counter() - t0
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompt, full, use_tqdm=False)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": 255 / (total - ttft)}


@torch.no_grad()
def hf_single_stream(model) -> dict:
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(100, 49000) for _ in range(512)]])
    model.generate(ids, max_new_tokens=1, do_sample=False)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False, pad_token_id=2)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": 255 / (total - ttft)}


@torch.no_grad()
def matmul_bound(llm: LLM, batch_sizes=(1, 64)) -> dict:
    """Tokens/s if a step were nothing but this model's matmuls (separate q/k/v/gate/up/down/o and the
    LM head, each with torch's F.linear in the checkpoint's [out, in] layout, fp32)."""
    cfg = llm.engine.model_cfg
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * cfg.num_layers
    weights = [torch.randn(o, n) for o, n in shapes]
    lm_head = torch.randn(cfg.vocab_size, h)
    result = {}
    for bs in batch_sizes:
        xs = {n: torch.randn(bs, n) for n in {h, q, i}}

        def step(xs=xs):
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            torch.nn.functional.linear(xs[h], lm_head)

        step()
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            step()
        result[bs] = bs * reps / (time.perf_counter() - t0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only", nargs="*", default=["a", "b", "single", "bound"])
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vllm", type=Path, default=None, metavar="VENV", help="also vLLM's offline LLM, from VENV")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()

    rows = []
    totals: dict[str, float] = {}
    single_decode = None
    for name, make in (("a", workload_a), ("b", workload_b)):
        if name not in args.only:
            continue
        work = make()
        ours = run_pagoda(llm, work)
        totals[name] = ours["total_tok_s"]
        print(f"[{name}] pagoda: {ours}", flush=True)
        if hf is not None:
            best = max((run_hf(hf, work, bs) for bs in (16, 64)), key=lambda r: r["output_tok_s"])
            print(f"[{name}] hf best static batch: {best}", flush=True)
            rows.append((f"({name}) output tok/s", ours["output_tok_s"], best["output_tok_s"]))
        else:
            rows.append((f"({name}) output tok/s", ours["output_tok_s"], None))
        if args.vllm is not None:
            theirs = run_vllm(args.vllm, llm.engine.model_dir, work)
            print(f"[{name}] vllm offline: {theirs}", flush=True)
            rows.append((f"({name}) output tok/s vs vLLM", ours["output_tok_s"], theirs["output_tok_s"]))
    if "single" in args.only:
        ours = single_stream(llm)
        single_decode = ours["decode_tok_s"]
        theirs = hf_single_stream(hf) if hf is not None else None
        print(f"[single] pagoda: {ours}  hf: {theirs}", flush=True)
        rows.append(("single-stream decode tok/s", ours["decode_tok_s"], theirs and theirs["decode_tok_s"]))
        rows.append(("single-stream TTFT s (512 tok)", ours["ttft_s"], theirs and theirs["ttft_s"]))
    if "bound" in args.only:
        bound = matmul_bound(llm)
        print(f"[bound] F.linear-only tok/s by batch size: {bound}", flush=True)
        for bs, value in bound.items():
            rows.append((f"matmul bound tok/s at batch {bs}", value, None))
        for name, total in totals.items():  # prefill and decode tokens alike against the batch-64 bound
            rows.append((f"({name}) total tok/s / bound at 64", total / bound[64], None))
        if single_decode is not None:
            rows.append(("single-stream / bound at 1", single_decode / bound[1], None))

    print(f"\n{'metric':34} {'pagoda':>10} {'baseline':>10} {'ratio':>7}  (baseline: HF unless the row says vLLM)")
    for metric, ours, theirs in rows:
        ratio = f"{ours / theirs:6.2f}x" if theirs else ""
        theirs_text = f"{theirs:10.2f}" if theirs else f"{'':10}"
        print(f"{metric:34} {ours:10.2f} {theirs_text} {ratio:>7}")


if __name__ == "__main__":
    main()
