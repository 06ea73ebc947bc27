"""MXFP4 to float32 on the CPU (kernels/cpu/mxfp4.c): an expert's weights read straight from the 4-bit blocks."""

from __future__ import annotations

import torch

from pagoda.kernels.cpu.loader import load

# Below this many groups (of 32 values) one thread does it: waking the others costs more.
_THREADED_FROM = 1 << 14


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `pagoda.kernels.mxfp4.dequantize` (float32 on the CPU; other dtypes run the reference)."""
    lib = load()
    if lib is None or dtype != torch.float32 or not (blocks.is_contiguous() and scales.is_contiguous()):
        from pagoda.kernels.mxfp4 import dequantize as reference

        return reference(blocks, scales, dtype)
    return _dequantize(lib, blocks, scales)


def _dequantize(lib, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    groups = scales.numel()
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.float32)
    threads = torch.get_num_threads() if groups >= _THREADED_FROM else 1
    if groups:
        lib["mxfp4_dequantize_f32"](blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), groups, threads)
    return out
