"""The CPU's dense float32 linear on panel-packed weights (kernels/panels.py, kernels/cpu/panel_matmul.c)
against float64, at every tile shape of every instruction set this machine can run, and the layer
that uses it (engine_core/layers/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine_core.layers.linear import Linear
from pagoda.kernels import cpu, ops
from pagoda.kernels.cpu import panel_matmul
from pagoda.kernels.panels import PanelWeight
from tests.kernels import isa_variants
from tests.kernels.linear_checks import assert_close_to_exact, case

# Every tile height and its remainders (AVX-512: 8 rows, AVX2: 6 from 4 rows on, 3 below, scalar: 2),
# row counts past a chunk of x (~1 MiB of rows: 170 rows of 1,536 columns), and packed rows (from 48
# rows on, in chunks of ~512 KiB: 263 = 224 + 39 rows of 576 columns; a chunk's last tile of 8 rows, or
# AVX2's 6, padded with zero rows where the chunk does not fill it: 53, 263 and 400).
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 47, 48, 53, 64, 263, 400]
# (N, K): ragged N (the last tile partly or wholly padding), K of 1 and odd ones, SmolLM2's shapes.
SHAPES = [(1, 1), (17, 7), (33, 96), (100, 1536), (960, 576)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_round_trips_and_rows_are_the_weights_rows(n, k):
    w = case(n, k, 0, n * k)[0]
    panels = PanelWeight.pack(w)
    assert panels.data.shape == (-(-n // 32) * 2, k, 16)
    assert torch.equal(panels.unpack(), w)
    ids = torch.randint(0, n, (3, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(panels.rows(ids), w[ids])
    assert torch.equal(ops.embedding_rows(panels, ids, torch.float32), w[ids])


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64_at_every_tile_shape(m, n, k):
    w, bias, x = case(n, k, m, m * 1000 + n + k)
    panels = PanelWeight.pack(w)
    assert_close_to_exact(ops.panel_linear(x, panels), x, w, None)
    assert_close_to_exact(ops.panel_linear(x, panels, bias), x, w, bias)


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("panel_matmul", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", [(17, 7), (100, 1536), (960, 576)])
def test_other_instruction_sets_match_float64(variant_libraries, variant, m, n, k):
    w, bias, x = case(n, k, m, m * 1000 + n + k + 1)
    y = panel_matmul._panel_linear(variant_libraries[variant], x, PanelWeight.pack(w), bias)
    assert_close_to_exact(y, x, w, bias)


@pytest.mark.parametrize("m", [23, 53, 263])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count(m):
    """Each output is one thread's sum over k in order, whatever tile its row falls in, packed or not: a
    request's tokens do not change with what it is batched with."""
    w, bias, x = case(960, 576, m, 5)
    panels = PanelWeight.pack(w)
    batch = ops.panel_linear(x, panels, bias)
    alone = torch.cat([ops.panel_linear(x[i : i + 1], panels, bias) for i in range(len(x))])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.panel_linear(x, panels, bias), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [40, 80, 100, 150])
def test_packed_rows_over_a_long_k(n):
    """A long K (a large model's down projection), where a pass over the weights packs 64 rows rather than
    the ~512 KiB of them: 263 rows of 3,000 columns are chunks of 64, 64, 64, 64 and 7 (one tile of them,
    padded), each row's result the same bits as alone. N of 40, 80, 100 and 150 (4, 6, 8 and 10 panels) give
    AVX-512's three-panel tiles a partial one, a partial one at the end, two-panel ones after them, and
    two two-panel ones in place of a lone panel."""
    w, bias, x = case(n, 3000, 263, 9)
    panels = PanelWeight.pack(w)
    y = ops.panel_linear(x, panels, bias)
    assert_close_to_exact(y, x, w, bias)
    assert torch.equal(y[250:], ops.panel_linear(x[250:], panels, bias))


def test_inputs_of_any_layout_and_rank():
    w, bias, x = case(100, 96, 12, 6)
    panels = PanelWeight.pack(w)
    strided = torch.randn(96, 12).t()  # not contiguous
    assert_close_to_exact(ops.panel_linear(strided, panels, bias), strided, w, bias)
    three_d = x.reshape(3, 4, 96)
    y = ops.panel_linear(three_d, panels, bias)
    assert y.shape == (3, 4, 100)
    assert torch.equal(y.reshape(12, 100), ops.panel_linear(x, panels, bias))
    assert ops.panel_linear(x[:0], panels).shape == (0, 100)
    with pytest.raises(ValueError, match="95 features"):
        ops.panel_linear(x[:, :95], panels)


def test_the_compiled_kernel_is_what_runs():
    """A build failure must not fall back to the (unpacking) reference silently."""
    assert cpu.available(), "the C kernels must build on this machine"
    assert ops.compiled("panel_linear", torch.device("cpu"))


def _loaded_linear(n: int, k: int, **kwargs) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    layer = Linear(k, n, bias=True, dtype=torch.float32, **kwargs)
    w, bias, _ = case(n, k, 0, 7)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(bias)
    return layer, w, bias


def test_a_packed_linear_computes_from_panels_alone():
    layer, w, bias = _loaded_linear(100, 64)
    assert layer.pack_for_cpu(tied_embedding=True)
    assert layer.panels is not None and layer.packed is None
    assert layer.weight.numel() == 0  # no second copy, even as a tied embedding table: rows come from panels
    assert layer.weight_bytes() == layer.panels.nbytes() + 100 * 4
    x = torch.randn(5, 64)
    assert_close_to_exact(layer(x), x, w, bias)


def test_a_linear_with_a_fused_activation_keeps_onednn():
    """oneDNN applies the activation as it writes the output (BERT's GELU); the panels do not."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    layer, w, bias = _loaded_linear(64, 32, activation="gelu")
    assert layer.pack_for_cpu()
    assert layer.panels is None and layer.packed is not None
    x = torch.randn(3, 32)
    assert torch.allclose(layer(x), F.gelu(F.linear(x, w, bias)), atol=1e-5)


def test_a_bfloat16_linear_packs_for_onednn_where_the_cpu_has_bfloat16():
    """bfloat16 weights go to oneDNN's packed layout (the panels are float32) where the CPU has bfloat16
    instructions, and give F.linear's result within bfloat16's rounding of the output; elsewhere they stay
    plain (F.linear)."""
    w, bias, _ = case(96, 64, 0, 11)
    layer = Linear(64, 96, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w.bfloat16())
        layer.bias.copy_(bias.bfloat16())
    supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert layer.pack_for_cpu() == supported
    assert (layer.packed is not None) == supported and layer.panels is None
    x = torch.randn(5, 64).bfloat16()
    want = F.linear(x.float(), w.bfloat16().float(), bias.bfloat16().float())
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_avx2_and_avx512_builds_give_the_same_bits(variant_libraries):
    """Both sum each output over k in order with one FMA per term, whatever the tile: a model's tokens
    do not depend on which of the two a machine has (the scalar build, without FMA, rounds otherwise)."""
    if "avx2" not in variant_libraries:
        pytest.skip("this machine has no AVX-512 to compare AVX2 with")
    for m in (29, 53, 263):  # (both pack the last two's rows: AVX-512 into 8-row tiles of three panels, AVX2 6 x 1)
        w, bias, x = case(960, 576, m, 8)
        panels = PanelWeight.pack(w)
        assert torch.equal(
            panel_matmul._panel_linear(variant_libraries["avx2"], x, panels, bias), ops.panel_linear(x, panels, bias)
        )
