"""Quantized linear layers on CUDA.

Until the Triton W4A16 / W8A16 GEMM lands here, CUDA tensors use the reference (dequantize a slice of
output rows at a time, then a dense matmul), which is correct but not weight-bandwidth bound.
"""

from __future__ import annotations

from kernels.quantized import reference_linear as quantized_linear

__all__ = ["quantized_linear"]
