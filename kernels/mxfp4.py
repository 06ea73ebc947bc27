"""MXFP4 expert weights (gpt-oss's checkpoints), kept 4-bit in memory.

A checkpoint stores each expert projection [E, rows, cols] as `*_blocks` (uint8 [E, rows, cols/32, 16]: two
E2M1 values a byte, the element at the even column in the low nibble) and `*_scales` (uint8 [E, rows,
cols/32]: a power-of-two exponent per 32 values, biased by 127). An E2M1 nibble is a sign bit and one of
the levels 0, .5, 1, 1.5, 2, 3, 4, 6. `Mxfp4Experts` holds those bytes as they are (4.25 bits a weight). On
the CPU the fused MoE's C kernel reads them itself (kernels/cpu/moe.c: each block's nibbles looked up in a
16-entry table scaled by its power of two, in registers inside the GEMM tiles, kernels/cpu/mxfp4_tiles.h);
elsewhere the torch reference (`fused_moe`, kernels/torch_ref/moe.py) dequantizes only the experts a step
chose, one at a time, through `matrix(e)` (`dequantize` below). `ops.mxfp4_dequantize` is the same
dequantization as an op, on the CPU a C kernel with the kernel's lookup (kernels/cpu/mxfp4.c); this module
does not call it, since the op table imports this module for its reference.

Why not repack into the INT4 layout of kernels/quantized.py: its groups are an affine grid (scale * q +
min, q = 0..15), and E2M1's levels are not evenly spaced (steps of .5, then 1, then 2), so no scale and
min hold them without rounding; INT8 could hold them exactly, but at twice the bytes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# The E2M1 value of each nibble (sign bit 3, then the level).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks` uint8 [..., rows, G, 16] and `scales` uint8 [..., rows, G] -> the weights [..., rows, G * 32]
    in `dtype` (each value times 2^(scale - 127), exactly: a power of two)."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.flatten(-2).to(dtype)


def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weights` [..., rows, cols] (cols a multiple of 32): each group's exponent the
    smallest that brings its largest magnitude within 6, each value rounded to the nearest E2M1 level
    (ties to the lower level). Writes MXFP4 checkpoints in tests; `dequantize` inverts it up to rounding."""
    *lead, cols = weights.shape
    groups = weights.float().reshape(*lead, cols // GROUP, GROUP)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, 127).to(torch.int32)
    scaled = torch.ldexp(groups, -exponent[..., None])
    levels = torch.tensor(E2M1_VALUES[:8])
    nearest = (scaled.abs()[..., None] - levels).abs().argmin(dim=-1)  # (first of equals: the lower level)
    nibbles = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    pairs = nibbles.reshape(*lead, cols // GROUP, GROUP // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


class Mxfp4Experts(nn.Module):
    """A layer's stacked expert projection [E, rows, cols] stored MXFP4: `blocks` and `scales` as the
    checkpoint has them. The loader fills them from `parts` checkpoint tensors each, every one a run of
    rows/parts rows of every expert (`shard`: gpt-oss's gate rows, then up rows). `matrix(e, dtype)` is
    expert e's [rows, cols] weight, dequantized alone."""

    def __init__(self, experts: int, rows: int, cols: int, dtype: torch.dtype, parts: int = 1):
        super().__init__()
        if cols % GROUP:
            raise ValueError(f"MXFP4 experts need a multiple of {GROUP} input columns, not {cols}")
        if rows % parts:
            raise ValueError(f"MXFP4 experts of {rows} rows cannot be filled from {parts} equal parts")
        groups = cols // GROUP
        self.blocks = nn.Parameter(torch.empty(experts, rows, groups, GROUP // 2, dtype=torch.uint8), False)
        self.scales = nn.Parameter(torch.empty(experts, rows, groups, dtype=torch.uint8), False)
        self.dtype = dtype
        self.parts = parts

    def shard_count(self, param: torch.Tensor) -> int:
        """Checkpoint tensors that fill `param` (blocks or scales): engine_core/models/checkpoint.py."""
        return self.parts

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The rows of every expert that checkpoint tensor `index` fills."""
        rows = param.shape[1] // self.parts
        return param[:, index * rows : (index + 1) * rows]

    def matrix(self, expert: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert `expert`'s weight [rows, cols], dequantized alone (the torch reference's path)."""
        return dequantize(self.blocks[expert], self.scales[expert], dtype or self.dtype)

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        """Random weights of std about 1/sqrt(cols), as the loader's dummy weights draw a matrix: random
        nibbles (whose levels have an RMS of about 2.9), every group's scale 2^round(log2(cols^-0.5 / 2.9))."""
        self.blocks.copy_(torch.randint(0, 256, self.blocks.shape, generator=generator, device=self.blocks.device))
        cols = self.blocks.shape[-2] * GROUP
        exponent = round(math.log2(cols**-0.5 / math.sqrt(sum(v * v for v in E2M1_VALUES[:8]) / 8)))
        self.scales.fill_(exponent + SCALE_BIAS)

    def dequantized(self) -> torch.Tensor:
        """Every expert's weights [E, rows, cols] (tests: the whole stack in full precision)."""
        return dequantize(self.blocks, self.scales, self.dtype)
