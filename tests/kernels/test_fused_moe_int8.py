"""Quantized experts through int8 activations (kernels/cpu/moe.c with the dense linear's integer tiles,
quantized_q8_tiles.h, where the CPU has VNNI): each pair's row is rounded to int8 per 32 columns before
gate/up and again before down, and the result is that arithmetic on the dequantized experts, at every top-k,
batch, group size and VNNI instruction set this machine runs. With int8 activations off the same experts keep
float activations (test_fused_moe_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.quantization.at_load import quantize_int4_grouped, quantize_int8_per_channel
from pagoda.kernels import cpu
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.quantized import PackedExperts, pack
from pagoda.kernels.torch_ref import moe
from tests.kernels import isa_variants

E, H, INTER = 12, 160, 40  # H: 5 blocks of 32 (a 4-bit unit holds 4 or 2: the last is partial); I pads to 64
KINDS = [(8, -1), (4, 32), (4, 64), (4, 128)]  # (bits, group): int8 per channel, int4 in groups

pytestmark = pytest.mark.skipif(
    not cpu.available() or "moe_q8_workspace" not in (cpu.load() or {}),
    reason="this CPU has no VNNI: quantized experts keep float activations",
)


@pytest.fixture(autouse=True)
def int8_activations():
    before = cpu.settings.int8_activations
    cpu.settings.int8_activations = True
    yield
    cpu.settings.int8_activations = before


def _experts(weights: torch.Tensor, bits: int, group: int) -> PackedExperts:
    packed = []
    for matrix in weights:
        shard = quantize_int8_per_channel(matrix) if bits == 8 else quantize_int4_grouped(matrix, group)
        packed.append(pack(shard.q, shard.scales, shard.mins, shard.bits, shard.group_size))
    return PackedExperts.stack("experts", packed)


def _layer(bits: int, group: int, inter: int = INTER, seed: int = 0) -> tuple[PackedExperts, PackedExperts]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, inter, generator=gen) * inter**-0.5
    return _experts(w13, bits, group), _experts(w2, bits, group)


def _inputs(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + tokens)
    hidden = torch.randn(tokens, H, generator=gen)
    hidden[0, 64:96] *= 1e-3  # (a quiet block: its own scale, not its row's)
    return hidden, torch.randn(tokens, E, generator=gen) * 2


def _rounded(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows rounded as the kernel rounds them, in float32 operations (Q8_0's: per 32 columns dx =
    max|x| / 127, q = round(x * (127 / max|x|)), ties to even): (q * dx in float64, each element's step dx,
    its distance from a rounding tie in steps)."""
    k = rows.shape[1]
    blocks = torch.nn.functional.pad(rows, (0, -k % 32)).reshape(rows.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    tiny = amax < 2.0**-120  # (the kernel's: such a block rounds to zeros)
    scaled = blocks * torch.where(tiny, 0.0, 127 / amax)
    dx = torch.where(tiny, 0.0, amax / 127).expand_as(blocks)
    tie = ((scaled - scaled.floor()) - 0.5).abs()
    return tuple(t.reshape(rows.shape[0], -1)[:, :k] for t in (torch.round(scaled).double() * dx, dx, tie))


def _expected(hidden, logits, w13: PackedExperts, w2: PackedExperts, routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer on int8-rounded rows of the dequantized experts, in float64; how far the kernel may be from
    it beyond float rounding: where an activation between the projections lies within float error of a
    rounding tie, the kernel's float32 gate/up may round it one step the other way)."""
    pairs = moe.assign(logits, routing, torch.float32)
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    slack = torch.zeros_like(out)
    start = 0
    for expert, count in zip(pairs.experts, pairs.counts, strict=True):
        tokens, weights = pairs.tokens[start : start + count], pairs.weights[start : start + count].double()
        start += count
        up, down = w13.matrix(expert).double(), w2.matrix(expert).double()
        gate_up = _rounded(hidden[tokens])[0] @ up.t()
        gate, value = gate_up.chunk(2, dim=1)
        act, step, tie = _rounded((torch.nn.functional.silu(gate) * value).float())
        out.index_add_(0, tokens, weights[:, None] * (act @ down.t()))
        slack.index_add_(0, tokens, weights.abs()[:, None] * ((step.double() * (tie < 1e-3)) @ down.abs().t()))
    return out, slack


def _assert_matches(got: torch.Tensor, hidden, logits, w13, w2, routing) -> None:
    expected, slack = _expected(hidden, logits, w13, w2, routing)
    error = (got.double() - expected).abs()
    allowed = 1e-5 + 1e-5 * expected.abs() + slack
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize("bits,group", KINDS)
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_experts_compute_on_the_rounded_rows(bits, group, tokens, top_k):
    w13, w2 = _layer(bits, group)
    assert cpu_moe.int8_activations(cpu.load(), w13, w2)
    hidden, logits = _inputs(tokens)
    routing = moe.Routing(top_k, True)
    _assert_matches(cpu.fused_moe(hidden, logits, w13, w2, routing), hidden, logits, w13, w2, routing)


@pytest.mark.parametrize("bits,group", KINDS)
@pytest.mark.parametrize("inter", [16, 100])
def test_any_intermediate_size(bits, group, inter):
    """Tensor parallel shards I: half a block, and three blocks and a bit (down's last unit partial)."""
    w13, w2 = _layer(bits, group, inter=inter)
    hidden, logits = _inputs(9)
    routing = moe.Routing(2, True)
    _assert_matches(cpu.fused_moe(hidden, logits, w13, w2, routing), hidden, logits, w13, w2, routing)


def test_int8_activations_off_keep_float_activations():
    w13, w2 = _layer(4, 32)
    hidden, logits = _inputs(5)
    routing = moe.Routing(2, True)
    cpu.settings.int8_activations = False
    assert not cpu_moe.int8_activations(cpu.load(), w13, w2)
    expected = moe.fused_moe(hidden, logits, w13, w2, routing)
    torch.testing.assert_close(cpu.fused_moe(hidden, logits, w13, w2, routing), expected, atol=2e-6, rtol=1e-5)


def test_a_library_without_the_layout_check_keeps_float_activations():
    """moe.c built alone (as the ISA-variant tests build it) has the int8 tiles but not quantized_matmul.c's
    check of which groups they fit: its experts keep float activations rather than failing."""
    lib = {name: fn for name, fn in cpu.load().items() if name != "quantized_q8_supported"}
    w13, w2 = _layer(4, 32)
    hidden, logits = _inputs(5)
    routing = moe.Routing(2, True)
    assert not cpu_moe.int8_activations(lib, w13, w2)
    expected = moe.fused_moe(hidden, logits, w13, w2, routing)
    got = cpu_moe._fused_moe(lib, hidden, logits, w13, w2, routing)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_token_s_result_does_not_depend_on_its_batch():
    """Each row is rounded on its own: a token alone gives the bits it gives among 16 others."""
    w13, w2 = _layer(4, 32)
    hidden, logits = _inputs(17)
    routing = moe.Routing(2, True)
    batch = cpu.fused_moe(hidden, logits, w13, w2, routing)
    assert torch.equal(cpu.fused_moe(hidden[5:6], logits[5:6], w13, w2, routing), batch[5:6])


def _vnni_variants() -> list[str]:
    """The other instruction sets this machine builds that have integer dot products (AVX-VNNI)."""
    return [name for name, flags in isa_variants.variants() if name == "avx-vnni"]


@pytest.fixture(scope="module")
def vnni_libraries(tmp_path_factory):
    """Each VNNI variant's moe and quantized_matmul functions (the int8 check lives in the latter)."""
    return {
        name: {
            **isa_variants.build("quantized_matmul", tmp_path_factory.mktemp(f"{name}-q"), flags),
            **isa_variants.build("moe", tmp_path_factory.mktemp(f"{name}-moe"), flags),
        }
        for name, flags in isa_variants.variants()
        if name in _vnni_variants()
    }


@pytest.mark.parametrize("variant", _vnni_variants())
@pytest.mark.parametrize("bits,group", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_other_instruction_sets_compute_on_the_rounded_rows(vnni_libraries, variant, bits, group, tokens):
    lib = vnni_libraries[variant]
    w13, w2 = _layer(bits, group)
    assert cpu_moe.int8_activations(lib, w13, w2)
    hidden, logits = _inputs(tokens)
    routing = moe.Routing(2, True)
    got = cpu_moe._fused_moe(lib, hidden, logits, w13, w2, routing)
    _assert_matches(got, hidden, logits, w13, w2, routing)
