"""GGUF's quantized linears, repacked into the quantization seat's layout (kernels/quantized.py).

The weights iterator (engine_core/gguf_weights.py) hands each quantized linear over raw: its blocks
(`gguf_blocks`, uint8 [rows, bytes per row]) and its GGML type (`gguf_type`). Each type becomes a
`QuantizedShard` of integers with one scale and one min per 32 columns (w = scale * q + min):

| type | GGUF block | stored as | how |
|---|---|---|---|
| Q4_0 | 32: d, 4-bit q | INT4 g32 | lossless: scale d, min -8d (w = d(q - 8)) |
| Q4_1 | 32: d, m, 4-bit q | INT4 g32 | lossless: scale d, min m (w = dq + m) |
| Q5_0 | 32: d, 5-bit q | INT8 g32 | lossless: scale d, min -16d |
| Q5_1 | 32: d, m, 5-bit q | INT8 g32 | lossless: scale d, min m |
| Q8_0 | 32: d, int8 q | INT8 g32 | lossless: symmetric, scale d |
| Q4_K | 256: d, dmin, 8 × 6-bit (sc, m), 4-bit q | INT4 g32 | lossless shard: scale d·sc, min -dmin·m per 32 columns |
| Q5_K | 256: as Q4_K, 5-bit q | INT8 g32 | as Q4_K |
| Q6_K | 256: d, 16 × int8 sc, 6-bit q | INT8 g32 | requantized: see below |

(d, m, dmin: float16; d·sc and dmin·m are exact in float32.) Q6_K's scales cover 16 columns and ours
32, so its weights are dequantized exactly in float32 and requantized, symmetric, per 32 columns with
the float16 scale just above absmax / 127: the error is at most half that scale, absmax / 254 (+ 2**-10
of it), about 1/8 of Q6_K's own step.

"Lossless" means the shard's `scale * q + min` equals `gguf.quants.dequantize` bit for bit (tested).
Packed for the kernels, scales are float16 and mins float16 where that is exact (kernels/quantized.py):
Q4_0, Q4_1, Q5_0 and Q8_0 stay exact (d and m are float16, and so are -8d and -16d); Q5_1 too, but the
8-bit layout's offset m + 128·d rounds in float32, so its matmul may round the last bit differently.
The K types' scales d·sc (up to 17 significant bits) round to float16, by at most 2**-11 of
themselves (1/2048 of a step); their mins dmin·m stay exact, in float32. Where a merged linear mixes
types (Q4_K_M files keep v_proj in Q6_K), `pack_shards` widens 4-bit shards to 8 bits, losslessly.
Float tensors (F32, F16, BF16) stay float; types not listed are refused when the file is opened
(engine_core/gguf_model.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagoda.engine_core.gguf_model import QUANTIZED_TYPES
from pagoda.engine_core.quantization.base import FLOAT16_SMALLEST, QuantizationMethod, QuantizedShard, float16_ceil

logger = logging.getLogger(__name__)

GROUP = 32

# GGML type number -> (name, columns per block, bytes per block): the file format's constants.
_GGML_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}

# How each type is stored, for the log line at load.
PATHS = {
    "Q4_0": "INT4 group 32, lossless",
    "Q4_1": "INT4 group 32, lossless",
    "Q5_0": "INT8 group 32, lossless",
    "Q5_1": "INT8 group 32, lossless",
    "Q8_0": "INT8 group 32, lossless",
    "Q4_K": "INT4 group 32, scales and mins rounded to float16",
    "Q5_K": "INT8 group 32, scales and mins rounded to float16",
    "Q6_K": "INT8 group 32, requantized (16-column scales do not fit 32-column groups)",
}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16·j] -> values [..., 32·j]: each 16 bytes hold 32 columns, low nibbles first."""
    lo, hi = packed & 15, packed >> 4
    return torch.cat([lo, hi], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> bits [..., 8n], bit b of byte i at 8i + b (little-endian bit fields)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b: torch.Tensor):
    return _nibbles(b[..., 2:18]), _f16(b, 0), None, 4


def _q4_1(b: torch.Tensor):
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4


def _q5_0(b: torch.Tensor):
    q = _nibbles(b[..., 6:22]) | (_bits(b[..., 2:6]) << 4)
    d = _f16(b, 0)
    return q, d, -16.0 * d, 8


def _q5_1(b: torch.Tensor):
    q = _nibbles(b[..., 8:24]) | (_bits(b[..., 4:8]) << 4)
    return q, _f16(b, 0), _f16(b, 2), 8


def _q8_0(b: torch.Tensor):
    q = b[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128
    return q, _f16(b, 0), None, 8


def _k_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, from its 12 bytes at 4..16: bytes 0-3
    hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from
    bytes 8-11 (low / high nibble) and their top 2 bits from bits 6-7 of bytes 0-3 / 4-7."""
    s = b[..., 4:16].to(torch.int32)
    sc_lo, m_lo, both = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([sc_lo & 63, (both & 15) | ((sc_lo >> 2) & 48)], dim=-1)
    mins = torch.cat([m_lo & 63, (both >> 4) | ((m_lo >> 2) & 48)], dim=-1)
    return scales, mins


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 values: each 32 bytes hold two 32-column sub-blocks, low nibbles first."""
    chunks = qs.unflatten(-1, (4, 32))
    return torch.stack([chunks & 15, chunks >> 4], dim=-2).flatten(-3)


def _q4_k(b: torch.Tensor):
    scales, mins = _k_scales_mins(b)
    return _k_low_nibbles(b[..., 16:144]), _f16(b, 0)[..., None] * scales, -(_f16(b, 2)[..., None] * mins), 4


def _q5_k(b: torch.Tensor):
    scales, mins = _k_scales_mins(b)
    # Bit j of high byte i is the fifth bit of column i of sub-block j.
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]
    high = ((b[..., 16:48].unsqueeze(-2) >> shifts) & 1).flatten(-2)
    q = _k_low_nibbles(b[..., 48:176]) | (high << 4)
    return q, _f16(b, 0)[..., None] * scales, -(_f16(b, 2)[..., None] * mins), 8


def q6_k_float(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [..., 210] -> float32 [..., 256]: w = d · sc[16-column sub-block] · (q - 32), q from a
    low nibble (128 bytes: per 128 columns, 64 bytes low then high nibbles) and 2 high bits (64 bytes:
    per 128 columns, 32 bytes holding four 32-column runs at bits 0, 2, 4, 6)."""
    low = b[..., 0:128].unflatten(-1, (2, 1, 64)) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]
    high = b[..., 128:192].unflatten(-1, (2, 1, 32)) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = ((low & 15).flatten(-3) | ((high & 3).flatten(-3) << 4)).to(torch.float32) - 32.0
    scale = _f16(b, 208)[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q.unflatten(-1, (16, 16))).flatten(-2)


def _q6_k(b: torch.Tensor):
    groups = q6_k_float(b).unflatten(-1, (8, GROUP))
    scales = float16_ceil(groups.abs().amax(dim=-1) / 127.0).clamp_min(FLOAT16_SMALLEST)  # as stored
    q = torch.round(groups / scales[..., None]).clamp_(-127, 127).to(torch.int16) + 128
    return q.flatten(-2), scales, None, 8


_DECODERS: dict[str, Callable] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
assert set(_DECODERS) == set(QUANTIZED_TYPES) == set(PATHS), "every type the loader accepts has a decoder"


def decode(blocks: torch.Tensor, type_number: int, in_features: int) -> tuple[str, QuantizedShard]:
    """A quantized GGUF weight (uint8 [rows, bytes per row]) -> (its type name, its QuantizedShard)."""
    if type_number not in _GGML_TYPES:
        raise ValueError(f"GGML type {type_number} is not supported; supported: {', '.join(QUANTIZED_TYPES)}")
    name, block_columns, block_bytes = _GGML_TYPES[type_number]
    rows = blocks.shape[0]
    if in_features % block_columns or blocks.shape[1] != in_features // block_columns * block_bytes:
        raise ValueError(
            f"{name} weight has {blocks.shape[1]} bytes per row, expected {in_features // block_columns} "
            f"blocks of {block_bytes} for {in_features} columns"
        )
    q, scales, mins, bits = _DECODERS[name](blocks.reshape(rows, -1, block_bytes))
    q = q.reshape(rows, in_features)
    scales = scales.reshape(rows, -1).float()
    mins = None if mins is None else mins.reshape(rows, -1).float()
    return name, QuantizedShard(q, scales, mins, bits=bits, group_size=GROUP)


class GGUFMethod(QuantizationMethod):
    name = "gguf"
    loads_experts = True
    kinds = frozenset({"gguf_blocks", "gguf_type"})
    required = kinds

    def __init__(self, tensor_types: dict[str, int] | None = None):
        self.tensor_types = dict(tensor_types or {})
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, quantization_config: dict) -> GGUFMethod:
        types = dict(quantization_config.get("tensor_types") or {})
        unknown = sorted(set(types) - set(QUANTIZED_TYPES))
        if unknown:
            raise ValueError(f"GGUF types {unknown} are not supported; supported: {', '.join(QUANTIZED_TYPES)}")
        return cls(types)

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> QuantizedShard:
        blocks = tensors["gguf_blocks"]
        if blocks.shape[0] != out_features:
            raise ValueError(f"{name}: GGUF weight has {blocks.shape[0]} rows, the model expects {out_features}")
        type_name, shard = decode(blocks, int(tensors["gguf_type"]), in_features)
        if type_name not in self._logged:
            self._logged.add(type_name)
            logger.info("GGUF %s weights: %s", type_name, PATHS[type_name])
        return shard

    def describe(self) -> str:
        types = ", ".join(f"{t} ×{n}" for t, n in self.tensor_types.items())
        return f"gguf ({types}; stored as INT4/INT8, group 32)" if types else "gguf"
