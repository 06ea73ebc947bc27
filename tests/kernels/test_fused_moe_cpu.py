"""The fused mixture-of-experts C kernel (kernels/cpu/moe.c, `pagoda.kernels.cpu.fused_moe`) against the torch
reference on the same packed experts: float32 panels (`ExpertPanels`) and int8 / int4 ones (`PackedExperts`),
at every top-k, batch and instruction set this machine runs; experts no token chose are never read; the
result does not depend on the thread count. gpt-oss's options and MXFP4 experts: test_fused_moe_cpu_gpt_oss.py."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.quantization.at_load import quantize_int4_grouped, quantize_int8_per_channel
from pagoda.kernels import cpu
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts, dequantize, pack
from pagoda.kernels.torch_ref import moe
from tests.kernels import isa_variants

E, H, INTER = 12, 48, 24  # H: the down projection's last tile half padding; I: not a multiple of 16
TOKENS = [1, 2, 5, 17, 64]

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the C kernels do not build")


def _weights(experts: int = E, inter: int = INTER, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, H, generator=gen) * H**-0.5
    w2 = torch.randn(experts, H, inter, generator=gen) * inter**-0.5
    return w13, w2


def _inputs(tokens: int, experts: int = E, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + tokens)
    return torch.randn(tokens, H, generator=gen), torch.randn(tokens, experts, generator=gen) * 2


def _quantized(weights: torch.Tensor, bits: int) -> PackedExperts:
    """Each expert quantized as --quantization int8 / int4 quantizes a dense linear."""
    packed = []
    for matrix in weights:
        shard = quantize_int8_per_channel(matrix) if bits == 8 else quantize_int4_grouped(matrix, 32)
        packed.append(pack(shard.q, shard.scales, shard.mins, shard.bits, shard.group_size))
    return PackedExperts.stack("experts", packed)


def _packed(kind: str, w13: torch.Tensor, w2: torch.Tensor):
    if kind == "float32":
        return ExpertPanels.pack(w13), ExpertPanels.pack(w2)
    bits = 8 if kind == "int8" else 4
    return _quantized(w13, bits), _quantized(w2, bits)


def _assert_matches_reference(got: torch.Tensor, hidden, logits, w13, w2, routing, atol: float = 2e-6) -> None:
    """Float32 sums in another order than the reference's (atol: more for longer sums)."""
    expected = moe.fused_moe(hidden, logits, w13, w2, routing)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5)


def test_packed_experts_give_back_each_experts_matrix():
    w13, _ = _weights()
    panels = ExpertPanels.pack(w13)
    assert panels.data.shape == (E, 2 * INTER // 16 + 1, H, 16)  # (2I = 48 rows padded to 64: 4 panels)
    assert all(torch.equal(panels.matrix(e), w13[e]) for e in range(E))
    quantized = _quantized(w13, 4)
    shard = quantize_int4_grouped(w13[3], 32)
    assert torch.equal(quantized.matrix(3), dequantize(pack(shard.q, shard.scales, shard.mins, 4, 32)))


def test_symmetric_and_asymmetric_experts_stack_into_one_layout():
    """An 8-bit expert without mins (symmetric) beside one with them: the stack stores the symmetric one's
    implicit mins, and every expert's matrix is unchanged."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (2, 8, 64), generator=gen)
    scales = torch.rand(2, 8, 1, generator=gen) + 0.1
    symmetric = pack(q[0], scales[0], None, 8, -1)
    shifted = pack(q[1], scales[1], -100 * scales[1], 8, -1)
    assert symmetric.mins is None and shifted.mins is not None
    stacked = PackedExperts.stack("experts", [symmetric, shifted])
    assert torch.equal(stacked.matrix(0), dequantize(symmetric)) and torch.equal(stacked.matrix(1), dequantize(shifted))


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_the_reference_on_the_same_packed_experts(kind, tokens, top_k, renormalize):
    w13, w2 = _packed(kind, *_weights())
    hidden, logits = _inputs(tokens)
    routing = moe.Routing(top_k, renormalize)
    _assert_matches_reference(cpu.fused_moe(hidden, logits, w13, w2, routing), hidden, logits, w13, w2, routing)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
@pytest.mark.parametrize("inter", [1, 16, 40, 100])
def test_any_intermediate_size(kind, inter):
    """Tensor parallel shards I: one column, a whole panel, and sizes that pad a tile and a 32-column block."""
    w13, w2 = _packed(kind, *_weights(inter=inter))
    hidden, logits = _inputs(9)
    routing = moe.Routing(2, True)
    _assert_matches_reference(cpu.fused_moe(hidden, logits, w13, w2, routing), hidden, logits, w13, w2, routing)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_an_expert_with_more_rows_than_a_block(kind):
    """A long prefill's expert: 4,096 columns, ~1 MiB of rows per block (64), so 150 tokens on 2 experts make
    two blocks or more of each, each block through all of its expert's tiles."""
    gen = torch.Generator().manual_seed(7)
    size, inter = 4096, 24
    w13 = torch.randn(2, 2 * inter, size, generator=gen) * size**-0.5
    w13, w2 = _packed(kind, w13, torch.randn(2, size, inter, generator=gen) * inter**-0.5)
    hidden, logits = torch.randn(150, size, generator=gen), torch.randn(150, 2, generator=gen)
    routing = moe.Routing(1, False)
    got = cpu.fused_moe(hidden, logits, w13, w2, routing)
    _assert_matches_reference(got, hidden, logits, w13, w2, routing, atol=2e-5)  # (sums of 4,096 products)


@pytest.mark.parametrize("kind", ["float32", "int4"])
@pytest.mark.parametrize("offset,local", [(0, 5), (4, 6), (9, 3)])
def test_expert_parallel_ranks_compute_their_experts_pairs(kind, offset, local):
    """A rank holding experts offset .. offset + local - 1 (their weights only): its pairs, and the ranks'
    partial sums add up to the whole layer's result."""
    full13, full2 = _weights()
    hidden, logits = _inputs(17)
    routing = moe.Routing(2, True, expert_offset=offset, local_experts=local)
    w13, w2 = _packed(kind, full13[offset : offset + local], full2[offset : offset + local])
    _assert_matches_reference(cpu.fused_moe(hidden, logits, w13, w2, routing), hidden, logits, w13, w2, routing)
    if kind == "float32":
        whole = cpu.fused_moe(hidden, logits, *_packed(kind, full13, full2), moe.Routing(2, True))
        parts = [(0, offset), (offset, local), (offset + local, E - offset - local)]
        total = sum(
            cpu.fused_moe(
                hidden, logits, *_packed(kind, full13[a : a + n], full2[a : a + n]), moe.Routing(2, True, False, a, n)
            )
            for a, n in parts
            if n
        )
        torch.testing.assert_close(total, whole, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_experts_no_token_chose_are_never_read(kind):
    """Experts 0, 5 and 11 hold NaN (NaN scales when quantized) and no token chooses them: the result is
    finite and equals that of the same experts holding zeros."""
    unchosen = [0, 5, 11]
    w13, w2 = _packed(kind, *_weights())
    hidden, logits = _inputs(17)
    logits[:, unchosen] = -1e4
    routing = moe.Routing(2, True)
    clean = cpu.fused_moe(hidden, logits, w13, w2, routing)
    for weights in (w13, w2):
        for e in unchosen:
            if kind == "float32":
                weights.data[e] = float("nan")
            else:
                weights.scales[e] = float("nan")
    got = cpu.fused_moe(hidden, logits, w13, w2, routing)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, clean)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_the_result_does_not_depend_on_the_thread_count(kind, int8_activations):
    """Also through int8 activations, where quantized experts take them (a CPU with VNNI)."""
    w13, w2 = _packed(kind, *_weights(inter=100))
    hidden, logits = _inputs(64)
    routing = moe.Routing(2, True)
    threads, before = torch.get_num_threads(), cpu.settings.int8_activations
    cpu.settings.int8_activations = int8_activations
    try:
        torch.set_num_threads(1)
        one = cpu.fused_moe(hidden, logits, w13, w2, routing)
        torch.set_num_threads(3)  # (more than this machine's 2 cores: the items split unevenly)
        three = cpu.fused_moe(hidden, logits, w13, w2, routing)
    finally:
        torch.set_num_threads(threads)
        cpu.settings.int8_activations = before
    assert torch.equal(one, three)


def test_no_pairs_and_no_tokens_give_zeros():
    w13, w2 = _packed("float32", *_weights())
    hidden, logits = _inputs(4)
    routing = moe.Routing(2, True, expert_offset=E, local_experts=3)  # (a rank none of whose experts is chosen)
    assert torch.equal(cpu.fused_moe(hidden, logits, w13, w2, routing), torch.zeros(4, H))
    assert cpu.fused_moe(torch.empty(0, H), torch.empty(0, E), w13, w2, moe.Routing(2, True)).shape == (0, H)


def test_plain_and_bfloat16_experts_run_the_reference():
    w13, w2 = _weights()
    hidden, logits = _inputs(5)
    routing = moe.Routing(2, True)
    assert torch.equal(cpu.fused_moe(hidden, logits, w13, w2, routing), moe.fused_moe(hidden, logits, w13, w2, routing))
    half = hidden.bfloat16()
    got = cpu.fused_moe(half, logits, w13.bfloat16(), w2.bfloat16(), routing)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, moe.fused_moe(half, logits, w13.bfloat16(), w2.bfloat16(), routing))


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("moe", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_other_instruction_sets_match_the_reference(variant_libraries, variant, kind, tokens):
    w13, w2 = _packed(kind, *_weights(inter=40))
    hidden, logits = _inputs(tokens)
    routing = moe.Routing(2, True)
    got = cpu_moe._fused_moe(variant_libraries[variant], hidden, logits, w13, w2, routing)
    _assert_matches_reference(got, hidden, logits, w13, w2, routing)
