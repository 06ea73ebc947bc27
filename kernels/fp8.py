"""FP8 (E4M3) linears: weights kept in FP8 with one scale per output channel, multiplied on FP8 tensor
cores through `torch._scaled_mm` (cuBLASLt), activations quantized to FP8 per token on the fly.

This is the W8A8 scheme of FP8 checkpoints with dynamic activation scales (llmcompressor's FP8_DYNAMIC,
vLLM's default): each input row x gets its own scale sx = max|x| / 448, so one outlier token costs no
other token its precision, and the output is sx[m] * sw[n] * (xq @ wq.T) summed in float32.

Where it runs: CUDA devices of compute capability 8.9 or newer (Ada, Hopper: the H200) with bfloat16
activations, and weight dimensions that are multiples of 16 (cuBLASLt's FP8 requirement). Elsewhere the
loader dequantizes FP8 weights once to the compute dtype instead (`supported` decides, per linear). The
CPU can run `_scaled_mm` too (torch 2.13), 40-50x slower than float32 `F.linear` on SmolLM2's shapes, so
it is never chosen there; the tests run it on the CPU to check the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class Fp8Weight:
    """An FP8 linear's weight: w[n, k] = weight[n, k] * scale[n]."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn, row-major (its transpose is the column-major operand)
    scale: torch.Tensor  # [N] float32, the dequantization factor of each output channel

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device).contiguous(), self.scale.to(device, torch.float32).contiguous())

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized: an embedding lookup in a tied FP8 LM head."""
        flat = ids.reshape(-1)
        w = self.weight[flat].float() * self.scale[flat].float()[:, None]
        return w.to(dtype).reshape(*ids.shape, self.in_features)

    @staticmethod
    def concat(parts: list[Fp8Weight]) -> Fp8Weight:
        """The rows of several linears sharing an input (merged QKV, gate+up) as one weight."""
        if len(parts) == 1:
            return parts[0]
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale.float() for p in parts]))


def quantize_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """Round a float weight [N, K] to E4M3 with each row's absmax at 448 (round to nearest)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(_TINY)
    return Fp8Weight((w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, K] -> (E4M3 rows, float32 scales [M, 1]) with each row's absmax at 448. No host sync, so
    it is captured in CUDA graphs with the rest of the step."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(_TINY)
    return (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def supported(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether an FP8 weight of this shape is multiplied in FP8 on `device` (else it is dequantized)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or out_features % 16 or in_features % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) in FP8 with per-token activation scales; output in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_per_token(rows)
    out = torch._scaled_mm(xq, w.weight.t(), scale_a=sx, scale_b=w.scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:  # added apart: _scaled_mm takes a bias only for some scale layouts and dtypes
        out = out + bias
    return out.reshape(*x.shape[:-1], w.out_features)


def reference_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch path: the dequantized weight (the weight-only reading of FP8; activations stay
    in x's dtype), for devices without FP8 matmuls and as the reference in tests."""
    return F.linear(x, w.dequantize(x.dtype), bias)
