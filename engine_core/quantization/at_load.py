"""Quantization at load (`--quantization int8|int4`): any full-precision checkpoint, round to nearest.

- int8: one scale per output channel, symmetric (absmax / 127): the error is far below the model's own
  noise (perplexity within ~0.1 %).
- int4: groups of 32 input columns with a scale and a min each (asymmetric, GGUF's Q4_1 block): the 16
  levels span each group's own range. The LM head is quantized to int8 per channel instead.

Why not larger groups and a 4-bit head, which would save ~10 % more memory: measured on SmolLM2
(`benchmarks/perplexity.py`, 3,000 tokens, 512-token windows), float32 34.17; int4 with groups of
128/64 and a 4-bit head 55.59 (+63 %); groups of 32 and a 4-bit head 36.19 (+5.9 %); groups of 32 and an
int8 head 34.24 (+0.2 %). A small model's logits are sensitive to its LM head, and its weights (here
from a Q4_1 file) suit 32-column groups.

Scales and mins are chosen as the float16 values the packed layout stores (kernels/quantized.py): the
scale rounded up and the int4 min rounded down, so the stored levels still span every weight, and the
integers are rounded against those stored values: each weight stays within half a step of its level.

Every linear is quantized (for SmolLM2 the head is also the embedding table, served from the int8 rows);
an untied embedding table stays in full precision (it is read a row at a time).
"""

from __future__ import annotations

import torch

from pagoda.engine_core.quantization.base import (
    FLOAT16_SMALLEST,
    QuantizationMethod,
    QuantizedShard,
    float16_ceil,
    float16_floor,
)

INT4_GROUP_SIZE = 32
INT8_MODULES = ("lm_head",)  # quantized to int8 per channel under --quantization int4


def quantize_int8_per_channel(weight: torch.Tensor) -> QuantizedShard:
    w = weight.float()
    scales = float16_ceil(w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(FLOAT16_SMALLEST)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int32) + 128
    return QuantizedShard(q, scales, None, bits=8, group_size=-1)


def quantize_int4_grouped(weight: torch.Tensor, group_size: int) -> QuantizedShard:
    w = weight.float()
    n, k = w.shape
    padded = -(-k // group_size) * group_size
    # Padding repeats the last column, so the partial group's range is that of its real columns.
    wp = torch.cat([w, w[:, -1:].expand(n, padded - k)], dim=1) if padded != k else w
    groups = wp.reshape(n, padded // group_size, group_size)
    low, high = float16_floor(groups.amin(dim=2)), groups.amax(dim=2)
    scales = float16_ceil((high - low) / 15.0).clamp_min(FLOAT16_SMALLEST)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.int32)
    return QuantizedShard(q.reshape(n, padded)[:, :k], scales, low, bits=4, group_size=group_size)


class Int8AtLoad(QuantizationMethod):
    name = "int8"
    quantizes_full_precision = True
    loads_experts = True

    def quantize(self, name: str, weight: torch.Tensor) -> QuantizedShard:
        return quantize_int8_per_channel(weight)

    def describe(self) -> str:
        return "int8 (weight-only, per channel, quantized at load)"


class Int4AtLoad(QuantizationMethod):
    name = "int4"
    quantizes_full_precision = True
    loads_experts = True

    def quantize(self, name: str, weight: torch.Tensor) -> QuantizedShard:
        if name in INT8_MODULES:
            return quantize_int8_per_channel(weight)
        return quantize_int4_grouped(weight, INT4_GROUP_SIZE)

    def describe(self) -> str:
        return "int4 (weight-only, groups of 32 with scale and min, LM head int8, quantized at load)"
