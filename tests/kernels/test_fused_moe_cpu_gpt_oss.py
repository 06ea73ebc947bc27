"""gpt-oss's experts in the fused mixture-of-experts C kernel (kernels/cpu/moe.c): expert biases, the clamped
SwiGLU and its top-k-then-softmax routing, with the experts as float32 panels (`ExpertPanels`), quantized
(`PackedExperts`) or MXFP4 read as stored (`Mxfp4Experts`, kernels/cpu/mxfp4_tiles.h), against the torch
reference (for MXFP4: on the same experts dequantized), at every top-k, batch and instruction set this
machine runs; the result does not depend on the thread count; experts no token chose are never read."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.quantization.at_load import quantize_int4_grouped
from pagoda.kernels import cpu
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts, pack
from pagoda.kernels.torch_ref import moe
from tests.kernels import isa_variants

E, H, INTER = 8, 96, 64  # (MXFP4: multiples of 32; H = 96 is three 32-column items of the down projection)
TOKENS = [1, 2, 5, 17, 64]
ROUTING = {k: moe.Routing(k, weights_in_hidden_dtype=True, softmax_after_topk=True) for k in (1, 2, 4)}
# A small limit, so that the clamps bite on many of the gate/up outputs (about N(0, 1) with the biases).
SWIGLU = moe.ClampedSwiGLU(alpha=1.702, limit=0.8)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the C kernels do not build")


def _experts(kind: str, seed: int = 0):
    """(w13, w2) of E experts in `kind`'s layout, and (w13, w2) as the reference multiplies them."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "mxfp4":
        w13, w2 = Mxfp4Experts(E, 2 * INTER, H, torch.float32), Mxfp4Experts(E, H, INTER, torch.float32)
        for w in (w13, w2):
            w.fill_dummy(gen)  # (every nibble; then each block's scale moved by -2 .. 2 powers of two)
            w.scales.copy_(w.scales.int() + torch.randint(-2, 3, w.scales.shape, generator=gen, dtype=torch.int32))
        return (w13, w2), (w13.dequantized(), w2.dequantized())
    dense13 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    dense2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    if kind == "float32":
        return (ExpertPanels.pack(dense13), ExpertPanels.pack(dense2)), (dense13, dense2)
    stacks = []
    for dense in (dense13, dense2):
        shards = [quantize_int4_grouped(matrix, 32) for matrix in dense]
        stacks.append(PackedExperts.stack("experts", [pack(s.q, s.scales, s.mins, 4, 32) for s in shards]))
    return tuple(stacks), tuple(torch.stack([s.matrix(e) for e in range(E)]) for s in stacks)


def _options(seed: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        w13_bias=torch.randn(E, 2 * INTER, generator=gen) * 0.5,
        w2_bias=torch.randn(E, H, generator=gen) * 0.5,
        activation=SWIGLU,
    )


def _inputs(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + tokens)
    return torch.randn(tokens, H, generator=gen), torch.randn(tokens, E, generator=gen) * 2


def _assert_matches_reference(got, hidden, logits, dense, routing, options) -> None:
    """Float32 sums in another order than the reference's; the weights themselves are the same values."""
    expected = moe.fused_moe(hidden, logits, *dense, routing, **options)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "mxfp4", "int4"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_gpt_oss_experts_match_the_reference(kind, tokens, top_k):
    (w13, w2), dense = _experts(kind)
    hidden, logits = _inputs(tokens)
    options = _options()
    got = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[top_k], **options)
    _assert_matches_reference(got, hidden, logits, dense, ROUTING[top_k], options)


@pytest.mark.parametrize("kind", ["float32", "mxfp4"])
def test_each_option_alone(kind):
    """Biases without the clamped SwiGLU, and the clamped SwiGLU without biases."""
    (w13, w2), dense = _experts(kind)
    hidden, logits = _inputs(9)
    full = _options()
    for options in ({"w13_bias": full["w13_bias"], "w2_bias": full["w2_bias"]}, {"activation": SWIGLU}, {}):
        got = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[2], **options)
        _assert_matches_reference(got, hidden, logits, dense, ROUTING[2], options)


def test_the_mxfp4_experts_are_read_where_they_are_stored(monkeypatch):
    """The C kernel reads the MXFP4 blocks itself: no expert is dequantized, and the torch reference never
    runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("an expert was dequantized, or the reference ran")

    (w13, w2), dense = _experts("mxfp4")
    hidden, logits = _inputs(17)
    want = moe.fused_moe(hidden, logits, *dense, ROUTING[4], **_options())
    monkeypatch.setattr(Mxfp4Experts, "matrix", refuse)
    monkeypatch.setattr(Mxfp4Experts, "dequantized", refuse)
    monkeypatch.setattr(cpu_moe.reference, "fused_moe", refuse)
    assert cpu_moe.runs_in_c(hidden, w13, w2, _options()["w13_bias"], _options()["w2_bias"])
    got = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[4], **_options())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "mxfp4"])
def test_the_result_does_not_depend_on_the_thread_count(kind):
    (w13, w2), _ = _experts(kind)
    hidden, logits = _inputs(64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[4], **_options())
        torch.set_num_threads(3)  # (more than a 2-core machine's cores: the items split unevenly)
        three = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[4], **_options())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("kind", ["float32", "mxfp4"])
def test_experts_no_token_chose_are_never_read(kind):
    """Experts 0, 3 and 7 hold NaN weights (MXFP4: infinite scales, which make NaN of a zero nibble) and
    NaN biases, and no token chooses them: the result is that of the same experts holding zeros."""
    unchosen = [0, 3, 7]
    (w13, w2), _ = _experts(kind)
    hidden, logits = _inputs(17)
    logits[:, unchosen] = -1e4
    options = _options()
    clean = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[2], **options)
    for weights, bias in ((w13, options["w13_bias"]), (w2, options["w2_bias"])):
        for e in unchosen:
            if kind == "float32":
                weights.data[e] = float("nan")
            else:
                weights.scales.data[e] = 255
            bias[e] = float("nan")
    got = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[2], **options)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, clean)


def test_plain_or_mixed_experts_and_other_dtypes_run_the_reference(monkeypatch):
    """What the C kernel does not read goes to the reference with the call's every argument: plain stacked
    tensors, w13 and w2 in two layouts, bfloat16 biases."""
    calls = []

    def reference(hidden, logits, w13, w2, routing, **options):
        calls.append((w13, options))
        return torch.full_like(hidden, 7.0)

    monkeypatch.setattr(cpu_moe.reference, "fused_moe", reference)
    (panels13, panels2), (dense13, dense2) = _experts("float32")
    (mx13, _), _ = _experts("mxfp4")
    hidden, logits = _inputs(3)
    options = _options()
    half = {**options, "w13_bias": options["w13_bias"].bfloat16()}
    for w13, w2, kwargs in ((dense13, dense2, options), (mx13, panels2, options), (panels13, panels2, half)):
        out = cpu.fused_moe(hidden, logits, w13, w2, ROUTING[2], **kwargs)
        assert calls[-1][0] is w13 and calls[-1][1] == kwargs and bool((out == 7.0).all())
    cpu.fused_moe(hidden, logits, panels13, panels2, ROUTING[2], **options)
    assert len(calls) == 3  # (panels and float32 options: the C kernel)


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("moe", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("kind", ["float32", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_other_instruction_sets_match_the_reference(variant_libraries, variant, kind, tokens):
    (w13, w2), dense = _experts(kind)
    hidden, logits = _inputs(tokens)
    options = _options()
    got = cpu_moe._fused_moe(variant_libraries[variant], hidden, logits, w13, w2, ROUTING[4], **options)
    _assert_matches_reference(got, hidden, logits, dense, ROUTING[4], options)
