"""Linear layers whose weight memory layout is chosen for the CPU's matrix-vector speed.

The weight is always exposed as `[out_features, in_features]` (what checkpoints hold and F.linear
takes), but on the CPU its storage is `[in, out]` when the output is at least as wide as the input:
MKL streams such weights up to 1.9x faster for a single decode token (576->3072: 21.5 vs 11.4 GB/s
here), while narrowing projections (1536->576) are faster in the usual layout. Large batches run at the
same speed either way. Merged layers (QKV, gate+up) make one matmul out of several small ones.

After loading, `pack_for_cpu` hands float32 CPU weights to oneDNN in its own blocked layout (packed
once, valid for any batch size): here 1.3x faster than MKL on the plain weight at one token and up
to 2.7x at 16. The plain weight is then released, unless another module reads it too.

A quantized linear holds a `kernels.PackedWeight` (integer weights with group scales) or a
`kernels.Fp8Weight` (FP8 on CUDA) instead (see engine_core/quantization). While a
quantized model is built (`deferred_weights()`), weights are not allocated: the loader either fills a
linear's packed weight or, for a layer the checkpoint keeps in full precision, allocates its weight
when the first tensor for it arrives (`materialize`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine_core.environment import onednn_linear_disabled
from kernels.fp8 import Fp8Weight
from kernels.quantized import PackedWeight

_deferred = False  # inside deferred_weights(): linears are built without weight storage


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Build linears without allocating their weights (a quantized checkpoint replaces most of them)."""
    global _deferred
    _deferred, previous = True, _deferred
    try:
        yield
    finally:
        _deferred = previous


def _weight(in_features: int, out_features: int, dtype, device=None) -> torch.Tensor:
    if _deferred and device is None:
        return torch.empty(out_features, in_features, dtype=dtype, device="meta")
    if device is None:
        device = torch.empty(0).device  # respects an enclosing `with torch.device(...)`
    if torch.device(device).type == "cpu" and out_features >= in_features:
        return torch.empty(in_features, out_features, dtype=dtype, device=device).t()
    return torch.empty(out_features, in_features, dtype=dtype, device=device)


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
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(_weight(in_features, out_features, dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN's layout of the weight, once packed
        self.quantized: PackedWeight | Fp8Weight | None = None  # the quantized weight, which replaces `weight`
        self._quantized_linear = kernels.quantized_linear  # the kernel op for `quantized`'s type

    @property
    def materialized(self) -> bool:
        return not self.weight.is_meta

    def materialize(self, device: torch.device) -> None:
        """Allocate the full-precision weight of a linear built under `deferred_weights()`."""
        if self.weight.is_meta:
            weight = _weight(self.in_features, self.out_features, self.weight.dtype, device)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def set_quantized(self, packed: PackedWeight | Fp8Weight) -> None:
        """From now on compute with `packed`; the full-precision weight is released."""
        if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight is {packed.out_features}x{packed.in_features}, "
                f"the layer is {self.out_features}x{self.in_features}"
            )
        self.quantized = packed
        self._quantized_linear = kernels.fp8_linear if isinstance(packed, Fp8Weight) else kernels.quantized_linear
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device="meta"), requires_grad=False)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight (packed, quantized or plain) and bias hold in memory."""
        total = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.quantized is not None:
            return total + self.quantized.nbytes()
        if self.packed is not None:
            return total + self.packed.numel() * self.packed.element_size()
        if not self.weight.is_meta:
            total += self.weight.numel() * self.weight.element_size()
        return total

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Use oneDNN's packed layout from now on (float32 on the CPU only); True if packed."""
        weight = self.weight
        if (
            self.quantized is not None
            or weight.device.type != "cpu"
            or weight.dtype != torch.float32
            or not _onednn_usable()
        ):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
        if not keep_weight:  # the packed copy replaces it: no second copy of the weights in memory
            self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self._quantized_linear(x, self.quantized, self.bias)
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
