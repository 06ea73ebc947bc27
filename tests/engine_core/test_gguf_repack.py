"""Each GGUF type, repacked into the quantization seat, against `gguf.quants.dequantize` (the gguf
package's reference): the shard's `scale * q + min` bit for bit for the lossless types, the packed
weight's dequantization (float16 scales) exact for the types whose scale is d, within float32 rounding
of the 8-bit offset for Q5_1, within float16 rounding of d·sc for the K types (their mins dmin·m are
kept exact, in float32); Q6_K within its stated requantization error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagoda.engine_core.gguf_model import QUANTIZED_TYPES
from pagoda.engine_core.quantization.base import QuantizedShard, pack_shards
from pagoda.engine_core.quantization.gguf import decode
from pagoda.kernels.quantized import dequantize as packed_dequantize

ROWS = 48
# The gguf package quantizes these; the K types (no quantizer there) get random blocks below.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# Packed scales are float16: exact for d (float16 in the file). The 8-bit layout adds min + 128 * scale
# to q - 128; where min is not a small multiple of the scale that sum rounds in float32 (Q5_1). The K
# types' scales d·sc round to float16; their mins dmin·m do not fit float16 and stay float32.
PACKED_EXACT = ("Q4_0", "Q4_1", "Q8_0", "Q5_0")
FLOAT16_ROUNDED = ("Q4_K", "Q5_K")


def _weights(columns: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of different magnitudes and a shifted mean, so scales and mins vary.
    return (rng.standard_normal((ROWS, columns)) * rng.uniform(0.01, 2.0, (ROWS, 1)) + 0.1).astype(np.float32)


def _random_blocks(ggml_type: GGMLQuantizationType, columns: int, seed: int) -> np.ndarray:
    """Random K-type blocks with sane float16 super-block scales (random bytes elsewhere: every
    scale, min and quant bit pattern is legal)."""
    block_columns, block_bytes = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (ROWS, columns // block_columns, block_bytes), dtype=np.uint8)
    d_offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[ggml_type.name]
    for offset in d_offsets:
        d = rng.uniform(1e-4, 1e-2, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(ROWS, -1)


def _raw(type_name: str, columns: int, seed: int) -> np.ndarray:
    ggml_type = GGMLQuantizationType[type_name]
    if type_name in K_TYPES:
        return _random_blocks(ggml_type, columns, seed)
    return gguf_quantize(_weights(columns, seed), ggml_type)


def test_every_accepted_type_is_covered_here():
    assert set(QUANTIZED_TYPES) == set(QUANTIZABLE) | set(K_TYPES)


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_TYPES)
def test_repacked_weights_equal_the_reference_dequantization(type_name):
    columns = 512  # two K super-blocks, 16 blocks of 32
    raw = _raw(type_name, columns, seed=len(type_name))
    ggml_type = GGMLQuantizationType[type_name]
    reference = torch.from_numpy(gguf_dequantize(raw, ggml_type).reshape(ROWS, columns).astype(np.float32))
    name, shard = decode(torch.from_numpy(raw), int(ggml_type), columns)
    assert name == type_name and shard.group_size == 32
    assert shard.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    packed = packed_dequantize(pack_shards("w", [shard]))
    if type_name == "Q6_K":
        # Requantized to 32-column groups: at most half an int8 step, absmax / 254 of each group (and
        # float32 rounding: the random blocks put some weights exactly half way between two steps).
        # The scale is the float16 just above absmax / 127, so half a step is up to 2**-10 more.
        absmax = reference.reshape(ROWS, -1, 32).abs().amax(-1, keepdim=True)
        bound = absmax / 254 * (1 + 2**-10) + absmax * 2**-20
        for weights in (shard.dequantize(), packed):
            assert bool(((weights - reference).reshape(ROWS, -1, 32).abs() <= bound).all())
        return
    assert torch.equal(shard.dequantize(), reference), "a lossless type must repack bit for bit"
    if type_name in PACKED_EXACT:
        assert torch.equal(packed, reference)
    elif type_name in FLOAT16_ROUNDED:
        # each weight off by at most 2**-11 of |scale * q| (the float16 rounding of the scale), plus the
        # float32 rounding of the sum (and of the 8-bit offset min + 128 * scale)
        q, scales, mins = shard.q.double(), shard.scales.double(), shard.mins.double()
        size = (scales.repeat_interleave(32, dim=1) * q).abs() * 2**-11
        size += (mins.abs() + 128 * scales.abs()).repeat_interleave(32, dim=1) * 2**-22
        assert bool(((packed.double() - reference.double()).abs() <= size).all())
        assert not torch.equal(packed, reference)  # (the rounding is real: these are not exact)
    else:
        _assert_within_int8_rounding(pack_shards("w", [shard]), packed, reference)


def test_a_merged_linear_of_mixed_types_is_widened_losslessly():
    # Q4_K_M files keep v_proj in Q6_K next to Q4_K q/k_proj; here Q4_0 / Q8_0 / Q5_1 shards.
    shards = [
        decode(torch.from_numpy(_raw(t, 256, i)), int(GGMLQuantizationType[t]), 256)[1]
        for i, t in enumerate(("Q4_0", "Q8_0", "Q5_1"))
    ]
    scale = torch.rand(ROWS, 1).half().float()  # a float16 scale, as packed: widening changes nothing
    per_channel = QuantizedShard(torch.randint(0, 16, (ROWS, 256)), scale, None, 4, -1)
    shards.append(per_channel)
    packed = pack_shards("qkv", shards)
    assert (packed.bits, packed.group_size) == (8, 32)
    expected = torch.cat([s.dequantize() for s in shards])
    _assert_within_int8_rounding(packed, packed_dequantize(packed), expected)


def _assert_within_int8_rounding(packed, weights: torch.Tensor, expected: torch.Tensor) -> None:
    """The 8-bit layout computes (q - 128) * scale + (min + 128 * scale): equal to scale * q + min up to
    float32 rounding of those terms, a few ulps of min + 128 * scale and of 128 * scale."""
    mins = torch.zeros_like(packed.scales) if packed.mins is None else packed.mins
    size = (mins.float().abs() + 128 * packed.scales.float().abs()).repeat_interleave(packed.group_size, dim=1)
    assert bool(((weights - expected).abs() <= size[:, : weights.shape[1]] * 2**-22).all())


def test_a_row_of_the_wrong_length_is_refused():
    raw = torch.from_numpy(_raw("Q4_1", 256, 0))
    with pytest.raises(ValueError, match="Q4_1 weight has 160 bytes per row, expected 9 blocks of 20 for 288 columns"):
        decode(raw, int(GGMLQuantizationType.Q4_1), 288)
    with pytest.raises(ValueError, match="GGML type 10 is not supported; supported: Q4_0, Q4_1"):
        decode(raw, int(GGMLQuantizationType.Q2_K), 256)
