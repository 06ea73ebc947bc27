"""What the op modules hand the C kernels besides their tensors' data: index tensors as int64, one float32
scratch buffer reused across calls, the row layout the kernels read, and when to wake threads."""

from __future__ import annotations

import torch

THREADED_WORK = 1 << 16  # multiply-adds below which one thread is faster than waking the others
_workspace = torch.empty(0)


def as_int64(index: torch.Tensor) -> torch.Tensor:
    """`index` as contiguous int64, itself when it is already (the usual case): two attribute reads
    instead of two dispatched torch ops, which add up over every layer's calls."""
    if index.dtype == torch.int64 and index.is_contiguous():
        return index
    return index.to(torch.int64).contiguous()


def scratch_buffer(numel: int) -> torch.Tensor:
    """A float32 scratch buffer reused across calls (grown when too small): no allocation per layer."""
    global _workspace
    if _workspace.numel() < numel:
        _workspace = torch.empty(max(numel, 2 * _workspace.numel()), dtype=torch.float32)
    return _workspace


def rows_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, D] whose heads of one token are adjacent (any token stride): views of a fused QKV output."""
    return x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
