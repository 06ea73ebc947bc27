"""Shared by the float32 linear kernels' tests: seeded cases, and float32's error bound from float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F

U = 2.0**-24  # float32's unit roundoff


def case(n: int, k: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within float32's error bound for sums of K products, from the float64 result."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), w.double().abs()) + (0 if bias is None else bias.double().abs())
    bound = 2 * (x.shape[-1] + 1) * U * magnitude + 1e-30
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())
