"""Each kernel the dispatcher picks, against its torch reference and the memory-bandwidth roofline.

On CUDA the dispatched kernels are the Triton ones; on the CPU, the compiled C kernels where they
exist (other ops dispatch to the reference itself, ratio 1.0). The roofline is the bytes a kernel must
move at least (read inputs once, write outputs once) divided by the copy bandwidth measured in the same
run (`dst.copy_(src)` of a large buffer, counting read + write).

The quantized table times `quantized_linear` on a model's linear shapes (int4 in groups of 128 with
mins, int8 per channel) at 1, 16 and 256 rows, against the dense `F.linear` in the run's dtype (bf16 on
CUDA) and against the weight-read bound: the packed weight's bytes (data, scales, mins) divided by the
copy bandwidth, the least time any weight-only kernel can take while the weights do not fit in cache.

    python -m benchmarks.kernel_ops                   # shapes for the device found: Llama-3-8B on CUDA,
                                                   # SmolLM2-135M on the CPU
    python -m benchmarks.kernel_ops --json out.json   # also save the rows
    python -m benchmarks.kernel_ops --only quantized  # one table: ops, quantized, dense or moe

The MoE table times the fused mixture-of-experts op's Triton kernel against its torch reference at
Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768, top-8, bf16) at 1, 16 and 256 tokens: each one's
largest error against the reference computed in float32, their largest difference, each one's time, and
the Triton op captured in a CUDA graph and replayed (its output must equal the eager call's), against the
bound of reading the chosen experts' weights once. On the CPU it runs only under Triton's interpreter
(TRITON_INTERPRET=1), at a tiny shape: a check that the table runs, not a timing.

The dense table (CPU only) times one pass over a whole model's float32 projections, each layer its own
copy of the weights as in a real step (so they stream from memory, not from cache): the panel matmul
the engine uses (kernels/panels.py) against oneDNN's packed matmul, the path it replaced
(`PAGODA_DISABLE_PANEL_LINEAR=1`), and MKL's F.linear, at decode and prefill row counts; and the same
rows as bulk rows (a long prompt's: on Intel's AMX where the CPU has it, kernels/cpu/amx_matmul.c)
against the panel matmul.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.kernels.fp8 import quantize_per_channel
from pagoda.kernels.ops import _TORCH, implementation
from pagoda.kernels.quantized import PackedWeight, pack


@dataclass(frozen=True)
class Shape:
    """A model's attention and MLP sizes, and the workload sizes to time them at."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    tokens: int  # prefill-sized element-wise ops
    decode_batch: int
    context: int  # tokens per sequence for decode attention
    prefill_seqs: int
    prefill_len: int
    vocab: int  # the LM head's logits per row, for greedy sampling's argmax (64 rows: a loaded decode step)


GPU_SHAPE = Shape(
    32, 8, 128, 4096, 14336, tokens=4096, decode_batch=64, context=4096, prefill_seqs=4, prefill_len=2048, vocab=128256
)
CPU_SHAPE = Shape(
    9, 3, 64, 576, 1536, tokens=1024, decode_batch=16, context=1024, prefill_seqs=2, prefill_len=512, vocab=49152
)

# (layer, in features, out features) of the quantized table: a fused QKV-sized, the fused gate/up and the
# down projection of Llama-3-8B on CUDA; SmolLM2-135M's fused QKV, gate/up and down on the CPU.
GPU_LINEARS = [("qkv", 4096, 12288), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
CPU_LINEARS = [("qkv", 576, 960), ("gate_up", 576, 3072), ("down", 1536, 576)]
# The dense table: SmolLM2-135M's four projections (QKV, output, gate/up, down) in each of its 30 layers.
DENSE_LAYER = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
DENSE_LAYERS = 30
DENSE_ROWS = (1, 4, 16, 64, 128, 512, 2048)
QUANTIZED_ROWS = (1, 16, 256)  # decode, batched decode, prefill-sized
QUANTIZED_FORMATS = [(4, 128, True), (8, -1, False)]  # (bits, group size, with mins): GPTQ/AWQ-like, per-channel
# The MoE table: (hidden, experts, expert width, top-k) of Qwen3-30B-A3B on CUDA, and the token counts; tiny
# ones under the interpreter.
GPU_MOE, GPU_MOE_TOKENS = (2048, 128, 768, 8), (1, 16, 256)
CPU_MOE, CPU_MOE_TOKENS = (64, 8, 32, 2), (1, 4)


def timed(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.3) -> float:
    """Median seconds per call over enough calls to fill `min_seconds` (after two warm-ups)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(), fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-6)
    samples = []
    for _ in range(max(5, min(200, int(min_seconds / once)))):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def copy_bandwidth(device: torch.device) -> float:
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * size / timed(lambda: dst.copy_(src), device)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def paged_cache(shape: Shape, num_tokens_per_seq: list[int], block_size: int, dtype, device):
    """A random KV cache whose blocks are handed to sequences in a shuffled order (like a busy pool)."""
    blocks_per_seq = [-(-n // block_size) for n in num_tokens_per_seq]
    total = sum(blocks_per_seq) + 1
    key_cache = torch.randn(total, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    order = (torch.randperm(total - 1) + 1).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(blocks_per_seq), width, dtype=torch.int64)
    offset = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor(order[offset : offset + count])
        offset += count
    return key_cache, value_cache, tables.to(device)


def cases(shape: Shape, dtype, device) -> list[tuple[str, str, Callable[[Callable], Callable], int]]:
    """(kernel, shape text, call(fn) -> thunk, minimum bytes moved)."""
    s, out = shape, []
    rand = lambda *size: torch.randn(*size, dtype=dtype, device=device)  # noqa: E731
    block_size = 16
    scale = s.head_dim**-0.5

    # decode attention: every sequence reads its whole context once
    lens = [s.context] * s.decode_batch
    kc, vc, tables = paged_cache(s, lens, block_size, dtype, device)
    seq_lens = torch.tensor(lens, device=device)
    q = rand(s.decode_batch, s.num_heads, s.head_dim)
    moved = 2 * s.decode_batch * s.context * s.num_kv_heads * s.head_dim * q.element_size() + 2 * nbytes(q)
    out.append(
        (
            "paged_decode_attention",
            f"{s.decode_batch}x{s.context} ctx, {s.num_heads}/{s.num_kv_heads} heads x {s.head_dim}",
            lambda f: lambda: f(q, kc, vc, tables, seq_lens, scale),
            moved,
        )
    )

    # prefill attention: fresh prompts (compute-bound; the roofline column is only a floor)
    lens = [s.prefill_len] * s.prefill_seqs
    pkc, pvc, ptables = paged_cache(s, lens, block_size, dtype, device)
    pq = rand(sum(lens), s.num_heads, s.head_dim)
    starts = torch.tensor([0] + [s.prefill_len * (i + 1) for i in range(s.prefill_seqs)], device=device)
    plens = torch.tensor(lens, device=device)
    moved = 2 * nbytes(pq) + 2 * sum(lens) * s.num_kv_heads * s.head_dim * pq.element_size()
    out.append(
        (
            "paged_prefill_attention",
            f"{s.prefill_seqs}x{s.prefill_len} causal",
            lambda f: lambda: f(pq, pkc, pvc, ptables, starts, plens, scale),
            moved,
        )
    )

    # cache-free attention over whole prompts: bidirectional as an encoder's (pooling models), and causal,
    # what a fresh prompt's prefill runs on the CPU (this step's own K/V, no cache read)
    vk, vv = rand(sum(lens), s.num_kv_heads, s.head_dim), rand(sum(lens), s.num_kv_heads, s.head_dim)
    for causal in (False, True):
        out.append(
            (
                "varlen_attention",
                f"{s.prefill_seqs}x{s.prefill_len} {'causal' if causal else 'bidirectional'}",
                lambda f, causal=causal: lambda: f(pq, vk, vv, starts, scale, causal),
                2 * nbytes(pq) + nbytes(vk) + nbytes(vv),
            )
        )

    # cache write: one decode step's worth of tokens per sequence, scattered over the pool
    k, v = rand(s.tokens, s.num_kv_heads, s.head_dim), rand(s.tokens, s.num_kv_heads, s.head_dim)
    wkc = torch.zeros(s.tokens // block_size + 8, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    wvc = torch.zeros_like(wkc)
    slots = torch.randperm(wkc.shape[0] * block_size, device=device)[: s.tokens]
    out.append(
        (
            "reshape_and_cache",
            f"{s.tokens} tokens",
            lambda f: lambda: f(k, v, wkc, wvc, slots),
            2 * (nbytes(k) + nbytes(v)),
        )
    )

    x, residual, weight = rand(s.tokens, s.hidden), rand(s.tokens, s.hidden), rand(s.hidden)
    out.append(("rms_norm", f"{s.tokens}x{s.hidden}", lambda f: lambda: f(x, weight, 1e-6), 2 * nbytes(x)))
    out.append(
        ("fused_add_rms_norm", f"{s.tokens}x{s.hidden}", lambda f: lambda: f(x, residual, weight, 1e-6), 4 * nbytes(x))
    )
    gate_up = rand(s.tokens, 2 * s.intermediate)
    out.append(
        ("silu_and_mul", f"{s.tokens}x2x{s.intermediate}", lambda f: lambda: f(gate_up), nbytes(gate_up) * 3 // 2)
    )
    rq, rk = rand(s.tokens, s.num_heads, s.head_dim), rand(s.tokens, s.num_kv_heads, s.head_dim)
    positions = torch.arange(s.tokens, device=device)
    cos_sin = torch.randn(s.tokens, s.head_dim, device=device)
    out.append(
        (
            "rotary_embedding",
            f"{s.tokens} tokens, {s.num_heads}+{s.num_kv_heads} heads",
            lambda f: lambda: f(positions, rq, rk, cos_sin, True),
            2 * (nbytes(rq) + nbytes(rk)),
        )
    )
    logits = torch.randn(64, s.vocab, dtype=torch.float32, device=device)
    out.append(("argmax_rows", f"64x{s.vocab} logits", lambda f: lambda: f(logits), nbytes(logits)))
    return out


def ops_table(shape: Shape, dtype, device, bandwidth: float) -> list[dict]:
    """Time each op's dispatched kernel and its torch reference; print and return the rows."""
    rows = []
    header = f"{'kernel':<24} {'shape':<34} {'ours ms':>9} {'torch ms':>9} {'speedup':>8} {'GB/s':>7} {'% copy bw':>9}"
    print(header)
    print("-" * len(header))
    for name, text, make, moved in cases(shape, dtype, device):
        ours = timed(make(implementation(name, device)), device)
        reference = timed(make(_TORCH[name]), device)
        row = {
            "kernel": name,
            "shape": text,
            "ours_ms": ours * 1e3,
            "torch_ms": reference * 1e3,
            "speedup": reference / ours,
            "gb_s": moved / ours / 1e9,
            "pct_copy_bw": 100 * moved / ours / bandwidth,
        }
        rows.append(row)
        print(
            f"{name:<24} {text:<34} {row['ours_ms']:>9.3f} {row['torch_ms']:>9.3f} {row['speedup']:>7.2f}x "
            f"{row['gb_s']:>7.0f} {row['pct_copy_bw']:>8.0f}%"
        )
    return rows


def random_packed(bits: int, group: int, with_mins: bool, k: int, n: int, device) -> PackedWeight:
    """A packed weight with random integers, scales and (with_mins) mins; its values do not matter here."""
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32, device=device)
    groups = -(-k // group) if 0 < group < k else 1
    scales = 0.001 + 0.01 * torch.rand(n, groups, device=device)
    mins = -scales * (1 << (bits - 1)) + 0.001 * torch.randn(n, groups, device=device) if with_mins else None
    return pack(q, scales, mins, bits, group)


def quantized_table(linears: list[tuple[str, int, int]], dtype, device, bandwidth: float) -> list[dict]:
    """Time the dispatched quantized_linear and the dense F.linear on each shape; print and return rows."""
    fn = implementation("quantized_linear", device)
    print(f"\nquantized_linear: {fn.__module__}.{fn.__name__} against F.linear in {dtype} and the weight-read bound")
    header = (
        f"{'layer':<8} {'K -> N':<14} {'rows':>4} {'format':<16} {'ours ms':>8} {'dense ms':>8} {'vs dense':>8} "
        f"{'bound ms':>8} {'x bound':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for layer, k, n in linears:
        dense_weight = torch.randn(n, k, dtype=dtype, device=device)
        packed = {fmt: random_packed(*fmt, k, n, device) for fmt in QUANTIZED_FORMATS}
        for m in QUANTIZED_ROWS:
            x = torch.randn(m, k, dtype=dtype, device=device)
            dense = timed(lambda x=x, w=dense_weight: torch.nn.functional.linear(x, w), device)
            for (bits, group, with_mins), weight in packed.items():
                ours = timed(lambda x=x, weight=weight: fn(x, weight), device)
                bound = weight.nbytes() / bandwidth
                fmt = f"int{bits} " + ("per-channel" if weight.num_groups == 1 else f"g{group}")
                fmt += " asym" if with_mins else ""
                row = {
                    "layer": layer,
                    "in_features": k,
                    "out_features": n,
                    "rows": m,
                    "format": fmt,
                    "weight_bytes": weight.nbytes(),
                    "ours_ms": ours * 1e3,
                    "dense_ms": dense * 1e3,
                    "bound_ms": bound * 1e3,
                    "vs_dense": dense / ours,
                    "x_bound": ours / bound,
                }
                rows.append(row)
                print(
                    f"{layer:<8} {f'{k} -> {n}':<14} {m:>4} {fmt:<16} {row['ours_ms']:>8.3f} {row['dense_ms']:>8.3f} "
                    f"{row['vs_dense']:>7.2f}x {row['bound_ms']:>8.3f} {row['x_bound']:>6.2f}x"
                )
    return rows


def dense_table(bandwidth: float) -> list[dict]:
    """CPU float32: a model's projections (DENSE_LAYERS copies of DENSE_LAYER) through the panel matmul,
    oneDNN's packed matmul and F.linear, once per pass; print and return rows."""
    from pagoda.kernels.panels import PanelWeight

    if not torch.backends.mkldnn.is_available():
        print("\ndense: this torch has no oneDNN; skipped")
        return []
    layers = [[torch.randn(n, k) * k**-0.5 for _, k, n in DENSE_LAYER] for _ in range(DENSE_LAYERS)]
    panels = [[PanelWeight.pack(w) for w in layer] for layer in layers]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in layers]
    weight_bytes = DENSE_LAYERS * sum(4 * k * n for _, k, n in DENSE_LAYER)
    fn = implementation("panel_linear", torch.device("cpu"))
    print(
        f"\ndense: {DENSE_LAYERS} layers x {len(DENSE_LAYER)} float32 projections ({weight_bytes / 2**20:.0f} MiB), "
        f"panels ({fn.__module__}.{fn.__name__}) against oneDNN packed and F.linear, {torch.get_num_threads()} threads"
    )
    header = f"{'rows':>5} {'panels ms':>9} {'oneDNN ms':>9} {'MKL ms':>8} {'oneDNN/panels':>13} {'MKL/panels':>10}"
    header += f" {'GB/s':>5} {'bulk ms':>8} {'panels/bulk':>11}"
    print(header)
    print("-" * len(header))
    rows = []

    def one_pass(matmul, weights, inputs) -> Callable[[], None]:
        def run() -> None:
            for layer in weights:
                for (_, k, _), w in zip(DENSE_LAYER, layer, strict=True):
                    matmul(inputs[k], w)

        return run

    def bulk_matmul(x, w):
        return fn(x, w, None, 0)  # (every row a bulk row)

    def onednn_matmul(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    cpu = torch.device("cpu")
    for m in DENSE_ROWS:
        inputs = {k: torch.randn(m, k) for k in {k for _, k, _ in DENSE_LAYER}}
        seconds = 0.2 if m < 512 else 1.0
        ours = timed(one_pass(fn, panels, inputs), cpu, seconds)
        packed = timed(one_pass(onednn_matmul, onednn, inputs), cpu, seconds)
        mkl = timed(one_pass(torch.nn.functional.linear, layers, inputs), cpu, seconds)
        bulk = timed(one_pass(bulk_matmul, panels, inputs), cpu, seconds)
        row = {"rows": m, "panels_ms": ours * 1e3, "onednn_ms": packed * 1e3, "mkl_ms": mkl * 1e3}
        row |= {"onednn_over_panels": packed / ours, "mkl_over_panels": mkl / ours, "gb_s": weight_bytes / ours / 1e9}
        row |= {"bulk_ms": bulk * 1e3, "panels_over_bulk": ours / bulk}
        rows.append(row)
        print(
            f"{m:>5} {row['panels_ms']:>9.2f} {row['onednn_ms']:>9.2f} {row['mkl_ms']:>8.2f} "
            f"{row['onednn_over_panels']:>12.2f}x {row['mkl_over_panels']:>9.2f}x {row['gb_s']:>5.1f} "
            f"{row['bulk_ms']:>8.2f} {row['panels_over_bulk']:>10.2f}x"
        )
    print(f"(the weights' read bound at the copy bandwidth: {weight_bytes / bandwidth * 1e3:.2f} ms per pass)")
    return rows


def fp8_table(linears: list[tuple[str, int, int]], dtype, device, bandwidth: float) -> list[dict]:
    """CUDA only: the FP8 linear (torch._scaled_mm, per-token activation scales) against F.linear in
    `dtype` and its weight-read bound. (On the CPU an FP8 weight is dequantized per call: nothing to time.)"""
    fn = implementation("fp8_linear", device)
    print(f"\nfp8_linear: {fn.__module__}.{fn.__name__} against F.linear in {dtype} and the weight-read bound")
    print(f"{'layer':<8} {'K -> N':<14} {'rows':>4} {'ours ms':>8} {'dense ms':>8} {'vs dense':>8} {'x bound':>7}")
    rows = []
    for layer, k, n in linears:
        dense_weight = torch.randn(n, k, dtype=dtype, device=device)
        weight = quantize_per_channel(dense_weight)
        for m in QUANTIZED_ROWS:
            x = torch.randn(m, k, dtype=dtype, device=device)
            dense = timed(lambda x=x, w=dense_weight: torch.nn.functional.linear(x, w), device)
            ours = timed(lambda x=x, w=weight: fn(x, w), device)
            bound = weight.nbytes() / bandwidth
            row = {"layer": layer, "in_features": k, "out_features": n, "rows": m, "format": "fp8 e4m3 per-channel"}
            row |= {"ours_ms": ours * 1e3, "dense_ms": dense * 1e3, "vs_dense": dense / ours, "x_bound": ours / bound}
            rows.append(row)
            print(
                f"{layer:<8} {f'{k} -> {n}':<14} {m:>4} {row['ours_ms']:>8.3f} {row['dense_ms']:>8.3f} "
                f"{row['vs_dense']:>7.2f}x {row['x_bound']:>6.2f}x"
            )
    return rows


def moe_table(
    moe_shape: tuple[int, int, int, int], token_counts: tuple[int, ...], dtype, device, bandwidth: float
) -> list[dict]:
    """The Triton fused_moe against the torch reference on `moe_shape`; print and return rows."""
    from pagoda.kernels.torch_ref import moe as reference
    from pagoda.kernels.triton import moe as triton_moe

    hidden_size, experts, inter, top_k = moe_shape
    print(
        f"\nfused_moe: Triton against the torch reference, hidden {hidden_size}, {experts} experts of {inter}, "
        f"top-{top_k}, {dtype}; errors against the reference in float32"
    )
    header = (
        f"{'tokens':>6} {'triton err':>10} {'ref err':>10} {'max diff':>10} {'triton ms':>9} {'ref ms':>9} "
        f"{'graph ms':>9} {'graph ==':>8} {'bound ms':>8} {'x bound':>7}"
    )
    print(header)
    print("-" * len(header))
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden_size, generator=gen, device=device) * hidden_size**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden_size, inter, generator=gen, device=device) * inter**-0.5).to(dtype)
    routing = reference.Routing(top_k, renormalize=True)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden_size, generator=gen, device=device).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen, device=device)
        exact = reference.fused_moe(x.float(), logits, w13.float(), w2.float(), routing)
        ours, ref = triton_moe.fused_moe(x, logits, w13, w2, routing), reference.fused_moe(x, logits, w13, w2, routing)
        row = {"tokens": tokens, "hidden": hidden_size, "experts": experts, "inter": inter, "top_k": top_k}
        row |= {
            "triton_err": (ours.float() - exact).abs().max().item(),
            "ref_err": (ref.float() - exact).abs().max().item(),
            "max_diff": (ours.float() - ref.float()).abs().max().item(),
            "max_abs": exact.abs().max().item(),
            "triton_ms": timed(lambda x=x, g=logits: triton_moe.fused_moe(x, g, w13, w2, routing), device) * 1e3,
            "ref_ms": timed(lambda x=x, g=logits: reference.fused_moe(x, g, w13, w2, routing), device) * 1e3,
        }
        chosen = torch.topk(logits, top_k, dim=-1).indices.unique().numel()  # (the experts whose weights are read)
        row["bound_ms"] = chosen * (w13[0].numel() + w2[0].numel()) * w13.element_size() / bandwidth * 1e3
        if device.type == "cuda":  # the op must be capturable: no host reads, no data-dependent shapes
            graph = torch.cuda.CUDAGraph()
            triton_moe.fused_moe(x, logits, w13, w2, routing)  # (compiled before capture)
            with torch.cuda.graph(graph):
                captured = triton_moe.fused_moe(x, logits, w13, w2, routing)
            graph.replay()
            row["graph_equal"] = bool(torch.equal(captured, ours))
            row["graph_ms"] = timed(graph.replay, device) * 1e3
        else:
            row["graph_equal"], row["graph_ms"] = None, float("nan")
        row["x_bound"] = row["triton_ms"] / row["bound_ms"]
        rows.append(row)
        print(
            f"{tokens:>6} {row['triton_err']:>10.2e} {row['ref_err']:>10.2e} {row['max_diff']:>10.2e} "
            f"{row['triton_ms']:>9.3f} {row['ref_ms']:>9.3f} {row['graph_ms']:>9.3f} {row['graph_equal']!s:>8} "
            f"{row['bound_ms']:>8.3f} {row['x_bound']:>6.2f}x"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="save the rows here")
    parser.add_argument(
        "--only", choices=["ops", "quantized", "dense", "moe"], default=None, help="run one table (default: all)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    rows = ops_table(shape, dtype, device, bandwidth) if args.only in (None, "ops") else []
    linears = GPU_LINEARS if device.type == "cuda" else CPU_LINEARS
    quantized = quantized_table(linears, dtype, device, bandwidth) if args.only in (None, "quantized") else []
    if args.only in (None, "quantized") and device.type == "cuda":
        quantized += fp8_table(linears, dtype, device, bandwidth)
    dense = dense_table(bandwidth) if args.only in (None, "dense") and device.type == "cpu" else []
    moe = []
    if args.only in (None, "moe"):
        if device.type == "cuda":
            moe = moe_table(GPU_MOE, GPU_MOE_TOKENS, dtype, device, bandwidth)
        elif os.environ.get("TRITON_INTERPRET") == "1":
            moe = moe_table(CPU_MOE, CPU_MOE_TOKENS, dtype, device, bandwidth)
        else:
            print("\nfused_moe: no GPU; the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "dtype": str(dtype),
                    "copy_gb_s": bandwidth / 1e9,
                    "rows": rows,
                    "quantized": quantized,
                    "dense": dense,
                    "moe": moe,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
