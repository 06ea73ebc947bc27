"""Linear layers whose weights are stored transposed, `[in_features, out_features]`.

On the CPU a single decode token multiplies every weight once (a matrix-vector product); MKL streams a
`[in, out]` weight about 1.4x faster than the usual `[out, in]` there (benchmarks/throughput.py bound
section), and large batches run at the same speed either way. Merged layers (QKV, gate+up) make one
large matmul out of several small ones.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy a checkpoint weight in Hugging Face's `[out, in]` layout."""
        self.weight_t.copy_(weight.t())
        if bias is not None:
            self.bias.copy_(bias)


class MergedLinear(Linear):
    """Several linears sharing an input, computed as one matmul; outputs are the column slices."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype=None):
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load_shard(self, index: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        start, size = self.offsets[index], self.out_sizes[index]
        self.weight_t[:, start:start + size].copy_(weight.t())
        if bias is not None:
            self.bias[start:start + size].copy_(bias)
