"""Quantized linears on the CPU: the packed layout round trip, and the C kernel (every path it takes:
fused for few rows, register tiles of dequantized weights for a batch, int8 activations where the CPU has VNNI,
oneDNN tiles for prefill) and the torch reference against dequantize + float64 matmul, on odd shapes.

Tolerances, both worst cases (the errors seen are 10-100x smaller, while a wrong nibble, group, min or
row is off by far more):
- float activations (`_bound`): float32 summation of K products in any order is off by at most
  K * u * sum|terms| (u = 2^-24, the unit roundoff; Higham's gamma_K). The terms the kernels sum are
  scale*q*x and min*x (the mins enter per group through sum(x)), so the bound is
  K * u * (|x| @ (|scale*q| + |min|)^T), doubled for the rounding of the dequantized weight (the tiled
  path) and of the final additions.
- int8 activations (`_int8_bound`): each x[m, k] becomes sx * round(x / sx), sx = max|x[m]| / 127, off
  by at most sx / 2, so y[m, n] is off by at most sx / 2 * sum_k |w[n, k]| (the integer sums are exact),
  plus the float bound above for the remaining float operations, with the unsigned weights' larger terms.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu, ops
from pagoda.kernels.cpu import quantized_matmul
from pagoda.kernels.quantized import (
    PackedWeight,
    dequantize,
    dequantize_original_order,
    offsets,
    pack,
    reference_linear,
    unpack,
)
from tests.kernels import isa_variants

U = 2.0**-24


@pytest.fixture(autouse=True, params=[False, True], ids=["float-activations", "int8-activations"])
def int8_activations(request):
    """This file checks every path of the kernel: each test runs with float activations, then with the
    opt-in int8 ones (which every row count below the oneDNN tiles takes where the CPU has VNNI)."""
    cpu.settings.int8_activations = request.param
    yield request.param
    cpu.settings.int8_activations = False


def _weight(
    n: int, k: int, bits: int, group: int, symmetric: bool, gen: torch.Generator, perm: bool = False, half=False
):
    """Random integers, scales and mins packed. Random mins are float32 (they stay so); `half`: float16
    values, which the layout stores in float16 (the kernels read both)."""
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    g = -(-k // (k if group <= 0 or group >= k else group))
    scales = torch.rand(n, g, generator=gen, dtype=torch.float64) * 0.02 + 0.001
    mins = None if symmetric else -torch.rand(n, g, generator=gen, dtype=torch.float64) * 0.1 * (1 << bits) * 0.02
    order = torch.randperm(k, generator=gen) if perm else None
    if mins is not None and half:
        mins = mins.half()
    return pack(q, scales.float(), None if mins is None else mins.float(), bits, group, order)


def _bound(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """2 * K * u * (|x| @ (|scale*stored| + |offset|)^T) in float64, x with columns in the kernel's order."""
    k = packed.in_features
    if packed.bits == 4:
        stored = unpack(packed).double()
    else:
        stored = packed.data[:, :k].double()
    scales = packed.scales.double().repeat_interleave(packed.group_size, dim=1)[:, :k]
    magnitude = (scales * stored).abs()
    offset = offsets(packed)
    if offset is not None:
        magnitude += offset.double().abs().repeat_interleave(packed.group_size, dim=1)[:, :k]
    return 2 * k * U * (x.double().abs().reshape(-1, k) @ magnitude.t()) + 1e-30


def _exact(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W'^T in float64 (x already in perm order), W' = the dequantized weight computed in float64
    (scale * q + min, from the stored float16 scales and mins)."""
    k = packed.in_features
    q = unpack(packed).double()
    w = q * packed.scales.double().repeat_interleave(packed.group_size, dim=1)[:, :k]
    symmetric = -float(1 << (packed.bits - 1)) * packed.scales.double()  # 8 bits without mins
    mins = packed.mins.double() if packed.mins is not None else symmetric if packed.bits == 8 else None
    if mins is not None:
        w += mins.repeat_interleave(packed.group_size, dim=1)[:, :k]
    y = x.double().reshape(-1, k) @ w.t()
    return y if bias is None else y + bias.double()


def _block_steps(rows: torch.Tensor) -> torch.Tensor:
    """Each element's int8 step, dx = max|x over its 32-column block| / 127 (the kernel's, Q8_0's)."""
    k = rows.shape[1]
    padded = torch.nn.functional.pad(rows.abs(), (0, -k % 32))
    return (padded.reshape(rows.shape[0], -1, 32).amax(dim=2) / 127).repeat_interleave(32, dim=1)[:, :k]


def _int8_bound(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    k = packed.in_features
    rows = x.double().reshape(-1, k)
    half_step = _block_steps(rows) / 2
    w = dequantize(packed).double()
    # The float operations see the unsigned integers (up to 255 for 8 bits) and mins shifted by 128 scales.
    scales = packed.scales.double().abs().repeat_interleave(packed.group_size, dim=1)[:, :k]
    offset = offsets(packed)
    mins = 0 if offset is None else offset.double().abs().repeat_interleave(packed.group_size, dim=1)[:, :k]
    magnitude = scales * (1 << packed.bits) * 2 + mins
    float_part = 2 * k * U * ((rows.abs() + half_step) @ magnitude.t())
    return half_step @ w.abs().t() + float_part + 1e-30


def _kernel_bound(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The bound for the path the C kernel takes on this input."""
    rows = x.reshape(-1, packed.in_features).shape[0]
    if cpu.path(cpu.load(), rows, packed) == "int8":
        return _int8_bound(x, packed)
    return _bound(x, packed)


def _assert_within(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    error = (y.double().reshape(exact.shape) - exact).abs()
    worst = float((error / bound).max())
    assert worst <= 1.0, f"error {worst:.3g}x the bound (max abs error {float(error.max()):.3g})"


# ---- the packed layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,group", [(32, 32), (96, 64), (100, 32), (576, 64), (1536, 128), (70, -1)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_pack_unpack_dequantize_round_trip(bits, k, group, symmetric):
    gen = torch.Generator().manual_seed(bits * 1000 + k + group)
    n = 33
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    stored_group = k if group <= 0 else group
    g = -(-k // stored_group)
    # float16 values (what the layout stores), so that the only rounding left is float32's
    scales = (torch.rand(n, g, generator=gen) * 0.02 + 0.001).half().float()
    mins = None if symmetric else -torch.rand(n, g, generator=gen).half().float()
    packed = pack(q, scales, mins, bits, group)
    assert packed.padded_in_features % 32 == 0 and packed.data.shape[0] == n
    assert torch.equal(packed.scales.float(), scales)
    assert torch.equal(unpack(packed), q)
    assert torch.equal(unpack(packed, slice(5, 9)), q[5:9])
    expected_mins = -float(1 << (bits - 1)) * scales if symmetric else mins
    w = scales.double().repeat_interleave(stored_group, 1)[:, :k] * q.double()
    w += expected_mins.double().repeat_interleave(stored_group, 1)[:, :k]
    torch.testing.assert_close(dequantize(packed).double(), w, rtol=0, atol=4 * U * float(w.abs().max()))
    if bits == 8 and symmetric:
        assert packed.mins is None  # min + 128 * scale is zero: dropped
    else:
        assert torch.equal(packed.mins.float(), expected_mins)


@pytest.mark.parametrize("bits", [4, 8])
def test_scales_and_mins_are_stored_in_float16(bits):
    """The memory the layout takes: float16 scales (rounded to nearest), and float16 mins wherever that
    keeps every min exact (an 8-bit min kept as itself, not min + 128 * scale), counted at 2 bytes in
    `nbytes`. Mins float16 would round (zero points: -zero * scale) stay float32, exact."""
    gen = torch.Generator().manual_seed(bits)
    n, k, group = 40, 576, 32
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    mins = (-torch.rand(n, k // group, generator=gen) * 0.3).half().float()
    packed = pack(q, scales, mins, bits, group)
    assert packed.scales.dtype == packed.mins.dtype == torch.float16
    assert torch.equal(packed.scales, scales.half()) and torch.equal(packed.mins.float(), mins)
    assert packed.nbytes() == n * k * bits // 8 + 2 * (2 * n * (k // group))
    # Dequantized: scale * q + min from the float16 scales, off from the float32 ones by their rounding.
    w = q.double() * scales.double().repeat_interleave(group, 1) + mins.double().repeat_interleave(group, 1)
    rounding = scales.double() * q.double().reshape(n, -1, group).amax(-1) * 2**-11 + 2**-22
    assert bool(((dequantize(packed).double() - w).abs() <= rounding.repeat_interleave(group, 1)).all())
    # Zero points: mins a float16 cannot hold exactly stay float32 (4 bytes each).
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=gen).float()
    exact_scales = scales.half().float()
    with_zeros = pack(q, exact_scales, -zeros * exact_scales, bits, group)
    assert with_zeros.mins.dtype == torch.float32 and torch.equal(with_zeros.mins, -zeros * exact_scales)
    assert with_zeros.nbytes() == n * k * bits // 8 + (2 + 4) * n * (k // group)
    # Tiny scales become float16 subnormals (or zero), never an error.
    tiny = pack(q, torch.full_like(scales, 1e-7), mins, bits, group)
    assert float(tiny.scales[0, 0]) == pytest.approx(1e-7, abs=2**-25)


def test_a_scale_beyond_float16_is_refused_naming_the_layer():
    q = torch.randint(0, 16, (4, 64))
    scales, mins = torch.full((4, 2), 0.5), torch.full((4, 2), -4.0)
    scales[2, 1] = 70000.0
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.down_proj: a scale of 70000 is outside float16's range"):
        pack(q, scales, mins, 4, 32, name="layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match="a scale of 1e\\+06 is outside float16's range"):
        pack(q, torch.full((4, 2), 1e6), None, 8, 32)  # symmetric 8-bit: no min stored, the scale still checked
    # A min beyond float16's range is kept exactly, in float32 (as any min float16 would round).
    big = pack(q, torch.full((4, 2), 0.5), torch.full((4, 2), -70000.0), 4, 32)
    assert big.mins.dtype == torch.float32 and float(big.mins[0, 0]) == -70000.0
    with pytest.raises(ValueError, match="w: a min is not finite"):
        pack(q, torch.full((4, 2), 0.5), torch.full((4, 2), float("nan")), 4, 32, name="w")


# ---- the kernels against float64 --------------------------------------------------------------------

ROWS = [1, 3, 17, 40, 128]  # fused, batch, int8 and tiles, by bits and group size: see test_every_path_is_tested
IN_FEATURES = [32, 96, 100, 576, 1536]  # 100: padded to 128 in the packed blocks


def _implementations():
    return {"kernel": ops.quantized_linear, "reference": reference_linear}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("k", IN_FEATURES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("mins", ["symmetric", "float16", "float32"])
def test_quantized_linear_matches_float64(bits, group, k, m, mins):
    gen = torch.Generator().manual_seed(bits * 100_000 + group * 1000 + k * 10 + m + len(mins))
    n = 33 if (k + m) % 2 else 100
    packed = _weight(n, k, bits, group, mins == "symmetric", gen, half=mins == "float16")
    assert packed.mins is None or packed.mins.dtype == {"float16": torch.float16, "float32": torch.float32}.get(
        mins, torch.float16
    )
    x = torch.randn(m, k, generator=gen)
    exact = _exact(x, packed)
    for name, fn in _implementations().items():
        y = fn(x, packed)
        assert y.shape == (m, n) and y.dtype == torch.float32, name
        _assert_within(y, exact, _kernel_bound(x, packed) if name == "kernel" else _bound(x, packed))


@pytest.mark.parametrize("bits,group", [(8, -1), (8, 128), (8, 32), (4, 128), (4, 64), (4, 32)])
@pytest.mark.parametrize("m", [1, 16])
def test_int8_path_computes_with_the_rounded_rows(bits, group, m, int8_activations):
    """Exactly the x that int8 activations stand for: dx * round(x / dx) per 32-column block (rounded to
    nearest even in float32, as the kernel does), against which only float rounding remains."""
    lib = cpu.load()
    gen = torch.Generator().manual_seed(bits + group + m)
    packed = _weight(45, 576, bits, group, False, gen)
    if cpu.path(lib, m, packed) != "int8":
        pytest.skip("int8 activations are off, or this CPU has no VNNI")
    x = torch.randn(m, 576, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    top = x.reshape(m, -1, 32).abs().amax(dim=2, keepdim=True)  # float32 throughout, like the kernel
    rounded = (torch.round(x.reshape(m, -1, 32) * (127.0 / top)) * (top / 127.0)).reshape(m, -1)
    y = ops.quantized_linear(x, packed)
    float_part = _int8_bound(x, packed) - (_block_steps(x.double()) / 2) @ dequantize(packed).double().abs().t()
    _assert_within(y, _exact(rounded, packed), float_part)


def test_every_path_is_tested(int8_activations):
    """The shapes above send work down each path the kernel has on this machine: with int8 activations
    (where the CPU has VNNI) every row count below the oneDNN tiles, every group size, takes them."""
    lib = cpu.load()
    taken = {
        cpu.path(lib, m, _weight(33, k, bits, group, True, torch.Generator().manual_seed(0)))
        for bits in (4, 8)
        for group in (32, 64, 128, -1)
        for k in IN_FEATURES
        for m in ROWS
    }
    vnni = "quantized_linear_q8_f32" in lib
    assert taken == ({"int8", "tiles"} if int8_activations and vnni else {"fused", "batch", "tiles"})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 17, 128])
def test_act_order_bias_and_3d_input(bits, m):
    gen = torch.Generator().manual_seed(bits + m)
    n, k = 71, 192
    packed = _weight(n, k, bits, 64, False, gen, perm=True)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(2, m, k, generator=gen)
    permuted = x.index_select(-1, packed.perm)
    exact = _exact(permuted, packed, bias).reshape(2, m, n)
    # The same product in the checkpoint's column order: the perm is applied to x, not forgotten.
    original = x.double() @ dequantize_original_order(packed).double().t() + bias.double()
    for name, fn in _implementations().items():
        bound = (_kernel_bound if name == "kernel" else _bound)(permuted, packed)
        bound = bound.reshape(2, m, n) + 2 * k * U * bias.abs().double()
        y = fn(x, packed, bias)
        assert y.shape == (2, m, n)
        _assert_within(y, exact, bound)
        _assert_within(y, original, bound)


@pytest.mark.parametrize("m", [1, 17, 128])
def test_non_contiguous_input(m):
    gen = torch.Generator().manual_seed(m)
    packed = _weight(50, 96, 4, 32, False, gen)
    wide = torch.randn(m, 3 * 96, generator=gen)
    x = wide[:, 96:192]  # rows 288 floats apart
    transposed = torch.randn(96, m, generator=gen).t()  # columns not adjacent
    for inp in (x, transposed):
        _assert_within(ops.quantized_linear(inp, packed), _exact(inp, packed), _kernel_bound(inp, packed))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 5, 17, 40])
def test_threads_split_the_rows_without_changing_a_bit(bits, m):
    """Each output is summed by one thread in a fixed order, whatever the thread count: results are
    identical with 1 and 2 threads (a shared workspace or a wrong strip offset would show here). Large
    enough (and repeated) that both threads surely run at once, even on a loaded machine."""
    gen = torch.Generator().manual_seed(bits * m)
    packed = _weight(16384, 576, bits, 64, False, gen)
    x = torch.randn(m, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.quantized_linear(x, packed)
        torch.set_num_threads(2)
        for _ in range(3):
            assert torch.equal(ops.quantized_linear(x, packed), one)
    finally:
        torch.set_num_threads(threads)
    _assert_within(one, _exact(x, packed), _kernel_bound(x, packed))


def test_unsupported_activation_dtype_falls_back_to_the_reference():
    gen = torch.Generator().manual_seed(0)
    packed = _weight(20, 64, 4, 32, False, gen)
    x = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    y = ops.quantized_linear(x, packed)
    assert y.dtype == torch.float64
    assert torch.equal(y, reference_linear(x, packed))


def test_empty_input():
    packed = _weight(20, 64, 8, 32, True, torch.Generator().manual_seed(0))
    assert ops.quantized_linear(torch.empty(0, 64), packed).shape == (0, 20)


def test_cpu_dispatch_runs_the_c_kernel():
    """A build failure must not fall back to the reference silently."""
    assert cpu.available(), "the C kernels must build on this machine"
    assert ops.implementation("quantized_linear", torch.device("cpu")) is cpu.quantized_linear
    assert {"quantized_linear_f32", "quantized_dequantize_f32"} <= set(cpu.load() or {})


# ---- the other instruction sets of the same source --------------------------------------------------


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("quantized_matmul", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k,group", [(96, 64), (100, 32), (576, -1), (512, 128)])
def test_other_instruction_sets_match_float64(variant_libraries, variant, bits, m, k, group):
    gen = torch.Generator().manual_seed(len(variant) * 100_000 + bits * 10_000 + m * 100 + k)
    # 8 bits symmetric (no mins); 4 bits with float16 or float32 mins, by shape
    packed = _weight(37, k, bits, group, bits == 8, gen, half=k % 3 == 0)
    bias = torch.randn(37, generator=gen)
    x = torch.randn(m, k, generator=gen)
    lib = variant_libraries[variant]
    y = quantized_matmul._quantized_linear(lib, x, packed, bias)
    bound = _int8_bound(x, packed) if cpu.path(lib, m, packed) == "int8" else _bound(x, packed)
    _assert_within(y, _exact(x, packed, bias), bound + 2 * k * U * bias.abs().double())


def test_int8_activations_are_opt_in():
    packed = _weight(64, 256, 8, -1, True, torch.Generator().manual_seed(3))
    cpu.settings.int8_activations = False
    assert {cpu.path(cpu.load(), m, packed) for m in (1, 16)} == {"fused", "batch"}


@pytest.mark.parametrize("bits,group", [(8, -1), (8, 32), (4, 32), (4, 128)])
def test_a_row_gives_the_same_bits_in_any_batch(bits, group, int8_activations):
    """With int8 activations a row is quantized and summed on its own, so its outputs are identical alone
    and in batches of any size below the oneDNN tiles (float activations: within float rounding)."""
    gen = torch.Generator().manual_seed(bits * group)
    packed = _weight(77, 320, bits, group, False, gen)
    x = torch.randn(40, 320, generator=gen)
    alone = torch.cat([ops.quantized_linear(x[i : i + 1], packed) for i in range(40)])
    for size in (2, 5, 16, 40):
        batched = torch.cat([ops.quantized_linear(x[i : i + size], packed) for i in range(0, 40, size)])
        if int8_activations and cpu.path(cpu.load(), size, packed) == "int8":
            assert torch.equal(batched, alone), size
        else:
            assert torch.allclose(batched, alone, rtol=1e-5, atol=1e-5), size
