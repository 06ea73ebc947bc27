"""The panel linear's bulk rows (kernels/cpu/amx_matmul.c: float32 as three bf16 pieces on Intel's AMX)
against float64, row by row against themselves in other batches, and beside the panel matmul's rows. On
a CPU without AMX (or with it turned off) the bulk rows are the panel matmul's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.kernels import cpu, ops
from pagoda.kernels.panels import PanelWeight
from tests.kernels.linear_checks import assert_close_to_exact, case


def _host_has_amx() -> bool:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)


AMX = _host_has_amx()
# Row counts around the 32-row blocks and past a chunk of pieces (1 MiB: 160 rows of K 1,536, 288 of K
# 576); (N, K): a partial column block, K not a multiple of a tile's 32 (and of 16), SmolLM2's shapes.
ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 170, 300]
SHAPES = [(1, 1), (17, 7), (40, 100), (100, 1536), (960, 576)]


def _bulk(x, panels, bias=None):
    return ops.panel_linear(x, panels, bias, bulk_rows_from=0)


def _panel(x, panels, bias=None):
    return ops.panel_linear(x, panels, bias)


def test_the_kernel_runs_where_the_cpu_has_amx():
    """A host with AMX must run it (a build or permission failure would fall back silently)."""
    w, _, x = case(64, 64, 40, 1)
    lib = cpu.load()
    assert lib is not None
    out = torch.empty(40, 64)
    panels = PanelWeight.pack(w)
    ran = lib["amx_linear_f32"](x.data_ptr(), panels.data.data_ptr(), None, out.data_ptr(), 40, 64, 64, 2)
    assert ran == int(AMX)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_bulk_rows_match_float64(m, n, k):
    w, bias, x = case(n, k, m, m * 1000 + n + k + 7)
    panels = PanelWeight.pack(w)
    assert_close_to_exact(_bulk(x, panels), x, w, None)
    assert_close_to_exact(_bulk(x, panels, bias), x, w, bias)


@pytest.mark.parametrize("n,k", [(40, 100), (960, 576), (100, 1536)])
def test_bulk_rows_are_as_close_to_float64_as_the_panel_matmuls(n, k):
    """fp32's error bound above is loose (K roundings); the six piece products give fp32's result to
    within its rounding, so the bulk rows' worst error is no larger than the panel matmul's, where a
    missing 2^-16 product would make it ~20x larger."""
    w, bias, x = case(n, k, 200, 13)
    panels = PanelWeight.pack(w)
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    bulk_error = (_bulk(x, panels, bias).double() - exact).abs().max()
    panel_error = (_panel(x, panels, bias).double() - exact).abs().max()
    assert bulk_error <= panel_error, (float(bulk_error), float(panel_error))


@pytest.mark.parametrize("n,k", [(40, 100), (960, 576), (100, 1536)])
def test_a_bulk_rows_result_does_not_depend_on_its_batch_or_the_thread_count(n, k):
    """Each output sums its row's pieces in one order, whatever the other rows, the row count (blocks
    padded with zero rows, chunks of pieces) and the threads: a long prompt's numbers do not change with
    what it is batched with."""
    w, bias, x = case(n, k, 300, 11)
    panels = PanelWeight.pack(w)
    batch = _bulk(x, panels, bias)
    for start, stop in [(0, 1), (5, 6), (7, 40), (31, 64), (100, 300), (299, 300)]:
        assert torch.equal(_bulk(x[start:stop], panels, bias), batch[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bulk(x, panels, bias), batch)
    finally:
        torch.set_num_threads(threads)


def test_rows_before_the_bulk_are_the_panel_matmuls_and_the_rest_the_bulk_kernels():
    w, bias, x = case(960, 576, 150, 3)
    panels = PanelWeight.pack(w)
    for split in (0, 1, 64, 149, 150, 400):
        y = ops.panel_linear(x, panels, bias, bulk_rows_from=split)
        head = min(split, 150)
        assert torch.equal(y[:head], _panel(x[:head], panels, bias))
        assert torch.equal(y[head:], _bulk(x[head:], panels, bias))
    if ops.bulk_rows_differ(torch.device("cpu")):  # (the other unit rounds its sums differently)
        assert not torch.equal(_bulk(x, panels, bias), _panel(x, panels, bias))


def test_amx_can_be_turned_off():
    w, bias, x = case(960, 576, 64, 4)
    panels = PanelWeight.pack(w)
    try:
        ops.configure(amx=False)
        assert torch.equal(_bulk(x, panels, bias), _panel(x, panels, bias))
        assert not ops.bulk_rows_differ(torch.device("cpu"))
    finally:
        ops.configure()
    assert ops.bulk_rows_differ(torch.device("cpu")) == AMX


def test_non_finite_inputs_stay_in_their_rows():
    """NaN gives NaN; an infinity gives NaN or infinity where it meets a weight (NaN on AMX: its pieces
    are infinity and then NaN); the other rows are untouched."""
    w, _, x = case(70, 96, 40, 5)
    x[3, 10] = float("nan")
    x[20, 0] = float("inf")
    panels = PanelWeight.pack(w)
    y = _bulk(x, panels)
    assert y[3].isnan().all() and not y[20].isfinite().any()
    clean = torch.cat([y[:3], y[4:20], y[21:]])
    assert clean.isfinite().all()
    assert torch.equal(clean, _bulk(torch.cat([x[:3], x[4:20], x[21:]]), panels))
