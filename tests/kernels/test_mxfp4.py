"""MXFP4 (kernels/mxfp4.py, kernels/cpu/mxfp4.c): the torch reference's dequantization equals HF's
(transformers.integrations.mxfp4), and the C kernel, built for every instruction set this machine runs
(tests/kernels/isa_variants.py), equals the reference bit for bit, every nibble and scales from the
smallest (a subnormal power of two) to the largest finite ones."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import mxfp4, ops
from pagoda.kernels.cpu import mxfp4 as cpu_mxfp4
from pagoda.kernels.cpu.loader import load
from tests.kernels import isa_variants


def _blocks_and_scales(shape=(3, 40, 5), seed=0):
    """Random bytes (every nibble appears) and scales over 0..254 (255 is infinity), [..., G, 16] / [..., G]."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
    edges = torch.tensor([0, 254, 1, 127], dtype=torch.uint8)
    scales.view(-1)[: min(4, scales.numel())] = edges[: scales.numel()]
    return blocks, scales


def test_the_reference_equals_hfs_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _blocks_and_scales()
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, rows, cols]
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(ours, hf.transpose(1, 2))


def test_quantize_round_trips_the_levels():
    """Weights already on the E2M1 grid times a power of two come back exactly."""
    gen = torch.Generator().manual_seed(1)
    levels = torch.tensor(mxfp4.E2M1_VALUES)[torch.randint(0, 16, (6, 64), generator=gen)]
    levels[:, ::32] = 6.0  # (each group's largest magnitude 6: its exponent is the one chosen)
    weights = levels * 2.0**-3
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(weights), torch.float32), weights)


def test_the_c_kernel_equals_the_reference():
    blocks, scales = _blocks_and_scales()
    if not ops.compiled("mxfp4_dequantize", torch.device("cpu")):
        pytest.skip("the CPU kernels are not built here")
    assert torch.equal(
        ops.mxfp4_dequantize(blocks, scales, torch.float32), mxfp4.dequantize(blocks, scales, torch.float32)
    )
    # Other dtypes and non-contiguous inputs take the reference.
    bf16 = ops.mxfp4_dequantize(blocks, scales, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, mxfp4.dequantize(blocks, scales, torch.bfloat16))
    strided = ops.mxfp4_dequantize(blocks[:, ::2], scales[:, ::2], torch.float32)
    assert torch.equal(strided, mxfp4.dequantize(blocks[:, ::2], scales[:, ::2], torch.float32))


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("mxfp4", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 33, 7), (4096, 9)])  # (the last: threaded)
def test_other_instruction_sets_agree(variant_libraries, variant, shape):
    blocks, scales = _blocks_and_scales(shape, seed=len(shape))
    got = cpu_mxfp4._dequantize(variant_libraries[variant], blocks, scales)
    assert torch.equal(got, mxfp4.dequantize(blocks, scales, torch.float32))


def test_mismatched_blocks_and_scales_are_refused():
    blocks, scales = _blocks_and_scales()
    lib = load()
    if lib is None:
        pytest.skip("the CPU kernels are not built here")
    with pytest.raises(ValueError, match="do not match"):
        cpu_mxfp4._dequantize(lib, blocks, scales[:, :-1])
