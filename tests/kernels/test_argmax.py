"""Greedy sampling's argmax kernel (kernels/cpu/argmax.c) against torch.argmax, index for index: ties go
to the first index, a NaN is the largest value, and every instruction-set build agrees."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import ops
from pagoda.kernels.cpu import argmax as cpu_argmax
from tests.kernels import isa_variants


def _rows(count: int, width: int, seed: int) -> torch.Tensor:
    """Small integers, so that every row has many ties for its largest value, with rows made hard."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (count, width), generator=generator).float()
    special = [
        lambda row: row.fill_(-math.inf),  # nothing but -inf: index 0
        lambda row: row.__setitem__(slice(None), torch.arange(width, 0, -1).float()),  # the first is largest
        lambda row: row.__setitem__(-1, 100.0),  # the last (a vector loop's scalar tail, for most widths)
        lambda row: row.__setitem__(width // 2, math.inf),
        lambda row: row.__setitem__([width - 1, width // 3], math.nan),  # the first NaN wins, wherever it is
        lambda row: row.__setitem__(0, math.nan),
        lambda row: row.__setitem__([width // 2, width - 1], 50.0),  # a tie in two lanes: the first
    ]
    for index, make in enumerate(special[:count]):
        make(logits[index])
    return logits


_WIDTHS = [1, 2, 15, 16, 17, 33, 1000, 49_152]  # (whole vectors of 16 lanes and their remainders)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("width", _WIDTHS)
def test_argmax_rows_is_torch_argmax(width, threads):
    logits = _rows(9, width, seed=width)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        picked = ops.argmax_rows(logits)
    finally:
        torch.set_num_threads(before)
    assert ops.compiled("argmax_rows", logits.device)
    assert picked.dtype == torch.int64
    assert picked.tolist() == logits.argmax(dim=-1).tolist()


def test_rows_a_stride_apart_and_what_the_kernel_does_not_take():
    wide = _rows(8, 2 * 49_152, seed=1)
    view = wide[:, 5 : 5 + 49_152]  # rows with a stride of their own (the LM head's rows of a larger batch)
    assert ops.argmax_rows(view).tolist() == view.argmax(dim=-1).tolist()
    columns = wide.t()[:100]  # (a last dimension that is not contiguous: the reference)
    assert ops.argmax_rows(columns).tolist() == columns.argmax(dim=-1).tolist()
    as_bf16 = _rows(4, 1000, seed=2).bfloat16()
    assert ops.argmax_rows(as_bf16).tolist() == as_bf16.argmax(dim=-1).tolist()
    assert ops.argmax_rows(torch.zeros(0, 7)).tolist() == []
    with pytest.raises(IndexError):
        ops.argmax_rows(torch.zeros(2, 0))  # (torch's own error: no values have no largest)


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("argmax", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("width", _WIDTHS)
def test_other_instruction_sets_agree(variant_libraries, variant, width):
    logits = _rows(9, width, seed=width + 7)
    assert cpu_argmax._argmax_rows(variant_libraries[variant], logits).tolist() == logits.argmax(dim=-1).tolist()
