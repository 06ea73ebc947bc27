"""A decoder layer's norms and activation on the CPU (kernels/cpu/layer_ops.c), float32: the torch
references' contracts (`pagoda.kernels.torch_ref.layers`), the fused decode step's math (layer_math.h)."""

from __future__ import annotations

import torch

from pagoda.kernels.cpu.loader import load


def _usable(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _threads() -> int:
    return torch.get_num_threads()  # (the C side keeps small passes on one thread)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. Rows of a token may be heads ([T, H, D] with a weight of D, as
    Qwen3's q/k norms): those may be a view with any token stride, as the split of a fused QKV output is."""
    lib = load()
    n = weight.shape[0]
    if lib is None or not _usable(weight) or x.dtype != torch.float32 or x.shape[-1] != n or x.dim() not in (2, 3):
        from pagoda.kernels.torch_ref.layers import rms_norm as reference

        return reference(x, weight, eps)
    heads = 1 if x.dim() == 2 else x.shape[1]
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != n):  # (a token's rows must be adjacent)
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    lib["rms_norm_f32"](
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], heads, n, x.stride(0), heads * n, eps, _threads()
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors."""
    lib = load()
    if lib is None or not _usable(x, residual, weight) or x.dim() != 2 or x.shape != residual.shape:
        from pagoda.kernels.torch_ref.layers import fused_add_rms_norm as reference

        return reference(x, residual, weight, eps)
    rows, n = x.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    lib["add_rms_norm_f32"](
        x.data_ptr(), residual.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n, eps, _threads()
    )
    return out, total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x` `[T, 2I]` holding gate and up halves -> silu(gate) * up `[T, I]`."""
    lib = load()
    if lib is None or not _usable(x) or x.dim() != 2 or x.shape[1] % 2:
        from pagoda.kernels.torch_ref.layers import silu_and_mul as reference

        return reference(x)
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    lib["silu_and_mul_f32"](x.data_ptr(), out.data_ptr(), rows, n, _threads())
    return out
