"""The fused mixture-of-experts op on CUDA: routing and grouping on the device, two Triton grouped GEMMs
and a fixed-order sum.

Same contract and signature as `pagoda.kernels.torch_ref.moe.fused_moe`. Every size is computed from
shapes, never from the routing (no `.item()`, `.tolist()` or data-dependent shape), so a call can be
captured in a CUDA graph:

1. Route with the reference's torch calls (`route`: float32 softmax, `torch.topk`, optional
   renormalisation), on the device. Each token's k pairs are put in ascending expert order, the order in
   which the reference adds them; under expert parallel other ranks' experts go to a sentinel bucket E.
2. Sort the T * k pairs by expert (stable: tokens ascending within an expert) and lay each expert's run
   out padded to a multiple of BLOCK_M, in a buffer of the worst-case size T * k + E * (BLOCK_M - 1)
   rounded up to BLOCK_M. Slots past a run hold the sentinel pair T * k. Each BLOCK_M-row block belongs to
   one expert (`block_expert`; E for the blocks past the last run, which do nothing).
3. `_gate_up_kernel`: per block, its tokens' rows times the expert's gate and up rows (two fp32
   accumulators), then SiLU-and-mul, into an intermediate `[padded, I]`.
4. `_down_kernel`: per block, the intermediate times the expert's down rows, times each pair's routing
   weight, into a per-pair output `[T * k, H]`.
5. `_sum_kernel`: each token's k pair outputs added in ascending expert order, skipping pairs of other
   ranks' experts.

Products accumulate in float32; the hidden dtype rounds where the reference rounds (each linear's output,
SiLU, its product with up, the weighted product, and each addition into the output), so bf16 and fp16
results track the reference's, not merely come close. An expert no token chose has no block, so its
weights are never read.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from pagoda.kernels.torch_ref import moe as _reference
from pagoda.kernels.triton.attention import _dot_precision

_SUM_BLOCK = 1024
_NUM_STAGES = 3  # K tiles in flight per GEMM program (its shared memory: tests/kernels/moe_sm90.py)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round float32 `x` to `dtype` and back: where the reference rounds (no-op for float32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. UPCAST (the interpreter only): the operands go to float32 first, because the interpreter
    multiplies bf16 operands' raw bit patterns; products of 16-bit floats are exact in float32, so the
    result is the one the GPU's fp32-accumulating tensor cores give."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


# The runtime sizes that vary between calls are not specialized on (divisibility by 16, equality to 1):
# each specialization would be another compile for no faster code.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GELU: tl.constexpr,
):
    """Program (block, N tile): rows block * BLOCK_M ... of the intermediate, columns of this N tile:
    silu(x W_gate^T) * (x W_up^T) for each row's token x and the block's expert (GELU: gelu with the tanh
    approximation instead of silu, Gemma 4's GeGLU). Padding rows give zeros."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last expert's run: nothing to compute, and nobody reads it
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs  # padding slots hold the sentinel num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter_size
    x_rows = hidden_ptr + tokens[:, None] * stride_hm
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_cols = w_base + n[None, :].to(tl.int64) * stride_wn  # W^T tiles: [BLOCK_K, BLOCK_N]
    up_cols = w_base + (n + inter_size)[None, :].to(tl.int64) * stride_wn

    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden_size
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = _dot(x, tl.load(gate_cols + k[:, None], mask=w_mask, other=0.0), gate, UPCAST, DOT_PRECISION)
        up = _dot(x, tl.load(up_cols + k[:, None], mask=w_mask, other=0.0), up, UPCAST, DOT_PRECISION)

    dtype = out_ptr.dtype.element_ty
    # The reference rounds the linear's output, then silu (F.silu) or gelu (F.gelu), then the product.
    gate = _round(gate, dtype)
    if GELU:  # (gelu_tanh(g) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): (1 + tanh u) / 2 = sigmoid 2u)
        inner = gate + 0.044715 * gate * gate * gate
        glu = _round(gate / (1.0 + tl.exp(-1.5957691216057308 * inner)), dtype)
    else:
        glu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    act = glu * _round(up, dtype)
    offsets = rows[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out_ptr + offsets, act.to(dtype), mask=n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,
    w2_ptr,
    weights_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    hidden_size,
    inter_size,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    WEIGHTS_IN_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (block, N tile): for each real pair of the block, (act W_down^T) times the pair's routing
    weight, into the pair's row of the per-pair output (row = token * k + slot)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden_size
    a_rows = act_ptr + rows[:, None].to(tl.int64) * stride_am
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inter_size
        a = tl.load(a_rows + k[None, :], mask=k_mask[None, :], other=0.0)  # (padding rows hold zeros)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, w, acc, UPCAST, DOT_PRECISION)

    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)  # float32
    if WEIGHTS_IN_DTYPE:  # (Qwen: the weight is rounded first and the product is taken in the hidden dtype)
        weight = _round(weight, dtype)
    y = _round(acc, dtype) * weight[:, None]  # (else: a float32 product, rounded once when stored)
    offsets = pairs[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out_ptr + offsets, y.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_kernel(
    pair_out_ptr,
    local_ids_ptr,
    out_ptr,
    num_experts,
    hidden_size,
    stride_pm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token, column block): the token's pair outputs added slot by slot (ascending expert order),
    rounded to the output dtype after each addition as the reference's index_add_ does. Pairs of other
    ranks' experts were never written and are skipped."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        # A skipped pair reads no columns (a row's width of 0 rather than a scalar mask term).
        width = tl.where(tl.load(local_ids_ptr + pair) < num_experts, hidden_size, 0)
        y = tl.load(pair_out_ptr + pair * stride_pm + cols, mask=cols < width, other=0.0).to(tl.float32)
        acc = _round(acc + y, dtype)
    tl.store(out_ptr + token * stride_om + cols, acc.to(dtype), mask=cols < hidden_size)


def _block_sizes(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps), from shapes only (graph-safe; no autotuning).

    Up to a few pairs per expert (decode): 16-row blocks (tl.dot's minimum), so padding wastes little,
    and long K tiles, since each expert's weights are read once and bandwidth is what counts. Larger
    batches: 64-row blocks for weight reuse. float32 operands take twice the shared memory per tile: half
    the K tile; and their exact (ieee) products run on FMA units with operands in registers, which a
    64 x 128 tile would spill: 64 columns."""
    if num_pairs <= 4 * num_experts:
        block_m, block_n, block_k, num_warps = 16, 64, 128, 4
    else:
        block_m, block_n, block_k, num_warps = 64, 128, 64, 8
    if dtype == torch.float32:
        block_n, block_k = 64, block_k // 2
    return block_m, block_n, block_k, num_warps


def _group_pairs(
    router_logits: torch.Tensor, routing: _reference.Routing, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T * k] float32, local expert ids [T * k] int32, sorted pairs [padded] int32, block experts
    [padded / block_m] int32), all from torch ops on the device with shape-only sizes.

    Within a token the pairs are in ascending expert order. A local id of `num_experts` marks another
    rank's expert. `sorted pairs` lists each expert's pairs (tokens ascending) in a run padded to a
    multiple of `block_m` with the sentinel T * k; `block experts` names each block's expert
    (`num_experts` past the last run)."""
    weights, ids = routing.weights_and_ids(router_logits)
    ids, order = ids.sort(dim=-1)  # the reference adds a token's experts in ascending order
    weights = weights.gather(-1, order)
    local = ids - routing.expert_offset
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts).reshape(-1)
    num_pairs = local.numel()
    device = local.device

    # A stable sort keeps tokens ascending within an expert; the sentinel bucket sorts last.
    sorted_ids, by_expert = torch.sort(local, stable=True)
    experts = torch.arange(num_experts + 1, device=device)
    starts = torch.searchsorted(sorted_ids, experts)  # starts[e]: first sorted pair of expert e
    counts = starts[1:] - starts[:-1]  # [E] (the sentinel bucket's pairs are not counted)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts

    padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    # Position of each sorted pair in the padded layout; the sentinel bucket's pairs go to a spare slot
    # `padded`, cut off below, so that no scatter needs a data-dependent mask.
    rank = torch.arange(num_pairs, device=device) - starts[sorted_ids]
    capped = sorted_ids.clamp(max=num_experts - 1)
    dest = torch.where(sorted_ids < num_experts, padded_starts[capped] + rank, padded)
    sorted_pairs = torch.full((padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, by_expert.to(torch.int32))
    block_starts = torch.arange(0, padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    return (
        weights.reshape(-1),
        local.to(torch.int32),
        sorted_pairs[:padded],
        block_expert.to(torch.int32),
    )


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: _reference.Routing,
    **options,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for tokens `hidden` [T, H] (fp32, fp16 or bf16); arguments
    as the reference's, Gemma 4's GeGLU activation and expert scales too. Other keyword `options` (expert
    biases, gpt-oss's activation), gpt-oss's routing and packed or quantized experts (ExpertPanels,
    PackedExperts, Mxfp4Experts) run the reference, which holds their math."""
    gelu = isinstance(options.get("activation"), _reference.GeGLU) and options.keys() == {"activation"}
    if (options and not gelu) or routing.softmax_after_topk or not isinstance(w13, torch.Tensor):
        return _reference.fused_moe(hidden, router_logits, w13, w2, routing, **options)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter_size = two_inter // 2
    top_k = routing.top_k
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    if hidden.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("hidden, w13 and w2 must have contiguous last dimensions")
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k, num_warps = _block_sizes(num_pairs, num_experts, hidden.dtype)
    weights, local_ids, sorted_pairs, block_expert = _group_pairs(router_logits, routing, num_experts, block_m)
    num_blocks = block_expert.numel()
    upcast = hidden.device.type != "cuda"  # the interpreter (see _dot)
    precision = _dot_precision(hidden.dtype)

    act = torch.empty(sorted_pairs.numel(), inter_size, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        hidden,
        w13,
        act,
        sorted_pairs,
        block_expert,
        num_pairs,
        num_experts,
        hidden_size,
        inter_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        GELU=gelu,
        num_warps=num_warps,
        num_stages=_NUM_STAGES,
    )
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act,
        w2,
        weights,
        pair_out,
        sorted_pairs,
        block_expert,
        num_pairs,
        num_experts,
        hidden_size,
        inter_size,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        pair_out.stride(0),
        WEIGHTS_IN_DTYPE=routing.weights_in_hidden_dtype,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=_NUM_STAGES,
    )
    _sum_kernel[(num_tokens, triton.cdiv(hidden_size, _SUM_BLOCK))](
        pair_out,
        local_ids,
        out,
        num_experts,
        hidden_size,
        pair_out.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
    )
    return out


__all__ = ["fused_moe"]
