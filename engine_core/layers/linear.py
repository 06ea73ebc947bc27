"""Linear layers whose weight memory layout is chosen for the CPU's matrix-vector speed.

The weight is always exposed as `[out_features, in_features]` (what checkpoints hold and F.linear
takes), but on the CPU its storage is `[in, out]` when the output is at least as wide as the input:
MKL streams such weights up to 1.9x faster for a single decode token (576->3072: 21.5 vs 11.4 GB/s
here), while narrowing projections (1536->576) are faster in the usual layout. Large batches run at the
same speed either way. Merged layers (QKV, gate+up) make one matmul out of several small ones.

After loading, `pack_for_cpu` hands float32 CPU weights to oneDNN in its own blocked layout (packed
once, valid for any batch size): here 1.3x faster than MKL on the plain weight at one token and up
to 2.7x at 16. The plain weight is then released, unless another module reads it too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.environment import onednn_linear_disabled


def _weight(in_features: int, out_features: int, dtype) -> torch.Tensor:
    on_cpu = torch.empty(0).device.type == "cpu"  # respects an enclosing `with torch.device(...)`
    if on_cpu and out_features >= in_features:
        return torch.empty(in_features, out_features, dtype=dtype).t()
    return torch.empty(out_features, in_features, dtype=dtype)


def _onednn_usable() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and not onednn_linear_disabled()
    )


def onednn_rows(count: int) -> int:
    """The row count a packed matmul runs at: `count` rounded up to one of ~40 sizes.

    oneDNN builds (and caches, up to 1,024 entries) a primitive per input shape, and each one holds
    megabytes of its own: with every step's token count a new shape, a server's memory grew by hundreds
    of MiB over a few thousand requests. Few sizes bound that cache. Small batches (decode) stay exact
    up to 16 rows, then round to 8 (weight-bandwidth-bound: extra rows are nearly free), large ones
    to 64 (at most a few % more compute where it matters)."""
    if count <= 16:
        return count
    if count <= 128:
        return -(-count // 8) * 8
    return -(-count // 64) * 64


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(_weight(in_features, out_features, dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN's layout of the weight, once packed

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Use oneDNN's packed layout from now on (float32 on the CPU only); True if packed."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not _onednn_usable():
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
        if not keep_weight:  # the packed copy replaces it: no second copy of the weights in memory
            self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.reshape(-1, x.shape[-1])
            count = rows.shape[0]
            padded = onednn_rows(count)
            if padded != count:
                rows = F.pad(rows, (0, 0, 0, padded - count))
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
            return out[:count].reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears sharing an input, computed as one matmul; outputs are the column slices."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype=None):
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The rows of `param` (weight or bias) that belong to the `index`-th merged linear."""
        return param[self.offsets[index] : self.offsets[index] + self.out_sizes[index]]
