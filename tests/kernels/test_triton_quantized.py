"""The Triton W4A16 / W8A16 GEMM against dequantize-then-matmul in float64, on the CPU through Triton's
interpreter (compiled on a GPU by benchmarks/gpu_check.sh).

Shapes are odd on purpose: N = 67 leaves a ragged output tile, K = 96 is not a multiple of its 64-column
groups (the last group is short), M = 17 and 128 take the multi-row tiles and 1 and 3 the decode tiles,
where K is split over programs whose fp32 partials a second kernel sums. Outputs and split partials are
NaN-poisoned while the kernel runs, so an element it fails to write shows up as NaN. Last, a small
Qwen2 quantized at load runs its linears on this kernel and must give the CPU path's greedy tokens.

bf16 runs only on a GPU: the interpreter computes `tl.dot` on bf16 operands wrongly (it multiplies their
raw 16-bit patterns; see test_triton_attention.py).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from pagoda.kernels.quantized import PackedWeight, dequantize, pack
from pagoda.kernels.triton import quantized as tri
from pagoda.kernels.triton.quantized import _exact_float
from tests import tiny_models
from tests.helpers import run_engine
from tests.kernels.devices import DEVICE, make_generator
from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's bf16 tl.dot is wrong")
    ),
]
# Largest error allowed, relative to the largest output: fp32 accumulates exactly enough for 1e-5; the
# 16-bit types are held to about two roundings of the output (2**-11 for fp16, 2**-8 for bf16).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# (K, group size): one 32-column block per row, a short last group, small groups, large, per-channel
SHAPES = [(32, -1), (96, 64), (576, 32), (576, 128), (576, -1)]


def random_weight(
    bits: int, n: int, k: int, group: int, gen: torch.Generator, asymmetric: bool = True, act_order: bool = False
) -> PackedWeight:
    """Random integers over the whole range, positive scales of mixed sizes, and (asymmetric) mins."""
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    groups = -(-k // group) if 0 < group < k else 1
    scales = 0.01 + 0.1 * torch.rand(n, groups, generator=gen)
    mins = -scales * torch.randint(0, 1 << bits, (n, groups), generator=gen) if asymmetric else None
    perm = torch.randperm(k, generator=gen) if act_order else None
    return pack(q, scales, mins, bits, group, perm)


def expected_output(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) in float64 from the dequantized weight, x's columns put in `perm` order first."""
    x64 = x.double()
    if packed.perm is not None:
        x64 = x64[..., packed.perm]
    out = x64 @ dequantize(packed, dtype=torch.float64).t()
    return out if bias is None else out + bias.double()


def check(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    with poisoned_empty():
        out = tri.quantized_linear(x, packed, bias)
    expected = expected_output(x, packed, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert not out.isnan().any(), "NaN in the output: an element or a split partial was never written"
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err <= TOL[x.dtype], f"max error {err:.2e} of the largest output"
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_dequantized_matmul(bits, rows, k, group, dtype):
    gen = make_generator(bits * 1000 + rows * 10 + k + group)
    packed = random_weight(bits, 67, k, group, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    check(x, packed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_weights(bits, rows, dtype):
    """Symmetric packing: 8-bit weights then store no mins (the kernel's mins-free path); 4-bit ones
    store -8 * scale. A 4-bit weight with no mins at all (w = scale * q) is valid too."""
    gen = make_generator(bits + rows)
    packed = random_weight(bits, 67, 96, 64, gen, asymmetric=False)
    assert (packed.mins is None) == (bits == 8)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    check(x, packed)
    if bits == 4:
        check(x, dataclasses.replace(packed, mins=None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_and_bias(bits, rows, dtype):
    """GPTQ act-order: the activations' columns are permuted; the bias is added once, after the split
    partials are summed (decode) or in the tile itself (one split)."""
    gen = make_generator(7 * bits + rows)
    packed = random_weight(bits, 67, 576, 64, gen, act_order=True)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    bias = torch.randn(67, generator=gen).to(dtype)
    check(x, packed, bias)


@pytest.mark.parametrize("bits", [4, 8])
def test_several_tiles_in_every_dimension(bits):
    """M = 130 and N = 261: two row tiles and three column tiles of 128, each with a ragged edge."""
    gen = make_generator(130 + bits)
    packed = random_weight(bits, 261, 576, 128, gen)
    check(torch.randn(130, 576, generator=gen), packed)


@pytest.mark.parametrize("bits", [4, 8])
def test_splits_of_several_k_tiles(bits):
    """K = 2048 in groups of 32: 64 K tiles over at most 32 splits, so each split sums two tiles."""
    gen = make_generator(2048 + bits)
    packed = random_weight(bits, 67, 2048, 32, gen)
    _, _, block_k, _, splits, tiles_per_split = tri._launch_shape(1, packed, torch.device(DEVICE))
    assert (block_k, splits, tiles_per_split) == (32, 32, 2)
    check(torch.randn(1, 2048, generator=gen), packed, torch.randn(67, generator=gen))


def test_unsplit_output_tiles_over_several_k_tiles():
    """Enough output tiles to fill the GPU: one split, every K tile in one program, bias in the tile."""
    gen = make_generator(3)
    rows, n = 1, 64 * 2 * tri._num_sms(torch.device(DEVICE))
    packed = random_weight(4, n, 64, 32, gen)
    assert tri._launch_shape(rows, packed, torch.device(DEVICE))[4] == 1  # one split of two K tiles
    check(torch.randn(rows, 64, generator=gen), packed, torch.randn(n, generator=gen))


def test_strided_and_batched_inputs():
    """A 3-D input keeps its leading dims; a column slice of a wider tensor (row stride != K) is read
    in place."""
    gen = make_generator(11)
    packed = random_weight(4, 67, 96, 32, gen)
    wide = torch.randn(5, 96 + 40, generator=gen, dtype=torch.float16)
    check(wide[:, 20:116], packed)
    batched = torch.randn(2, 3, 96, generator=gen, dtype=torch.float16)
    assert check(batched, packed).shape == (2, 3, 67)


def test_decode_splits_k_to_fill_the_gpu_and_wide_batches_do_not():
    """Llama-3-8B's down projection (K = 14336, groups of 128): one decode row would leave most SMs idle
    with 64 output tiles, so K is split until the grid holds about two programs per SM; 256 rows of its
    gate/up projection (N = 28672) make enough output tiles on their own. Shapes only: no data needed."""
    device, wanted = torch.device(DEVICE), 2 * tri._num_sms(torch.device(DEVICE))
    down = PackedWeight(4, 4096, 14336, 128, torch.empty(0), torch.empty(0), None)
    for rows in (1, 16):
        block_m, block_n, block_k, _, splits, tiles_per_split = tri._launch_shape(rows, down, device)
        assert block_m == 16 and splits > 1 and (splits - 1) * tiles_per_split < 14336 // block_k
        assert wanted <= (4096 // block_n) * splits < 2 * wanted
    gate_up = PackedWeight(4, 28672, 4096, 128, torch.empty(0), torch.empty(0), None)
    block_m, block_n, _, _, splits, _ = tri._launch_shape(256, gate_up, device)
    assert splits == 1 and (256 // block_m) * (28672 // block_n) >= wanted


@triton.jit
def _exact_float_kernel(u_ptr, out_ptr, SUBTRACT: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _exact_float(tl.load(u_ptr + i), SUBTRACT, out_ptr.dtype.element_ty))


@pytest.mark.parametrize(
    "dtype,subtract,count",
    [
        (torch.float16, 0, 16),
        (torch.float16, 128, 256),
        (torch.float32, 0, 16),
        (torch.float32, 128, 256),
        pytest.param(
            torch.bfloat16,
            0,
            16,
            marks=pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's bf16 arithmetic works on raw bits"),
        ),
    ],
)
def test_integers_become_floats_exactly(dtype, subtract, count):
    """The mantissa trick that turns packed integers into the activation dtype gives each value exactly
    (4-bit nibbles in every dtype, 8-bit bytes stored as q - 128 in fp16 and fp32)."""
    u = torch.arange(count, dtype=torch.uint8)
    out = torch.empty(count, dtype=dtype)
    _exact_float_kernel[(1,)](u, out, subtract, count)
    assert torch.equal(out, (u.to(torch.int32) - subtract).to(dtype))


def test_empty_input_and_bad_shapes():
    gen = make_generator(5)
    packed = random_weight(8, 67, 96, -1, gen)
    assert tri.quantized_linear(torch.empty(0, 96), packed).shape == (0, 67)
    with pytest.raises(ValueError, match="96"):
        tri.quantized_linear(torch.randn(2, 64), packed)


def test_cuda_tensors_dispatch_to_this_kernel():
    """ops.quantized_linear hands CUDA tensors to this kernel, which takes the reference's arguments."""
    assert ops.implementation("quantized_linear", torch.device("cuda")) is tri.quantized_linear
    reference = ops._TORCH["quantized_linear"]
    assert inspect.signature(tri.quantized_linear).parameters.keys() == inspect.signature(reference).parameters.keys()


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A random Qwen2 (biased QKV projections, so the kernel's bias path runs in the model)."""
    model = tiny_models.build(
        "qwen2", vocab_size=256, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False
    )
    path = tmp_path_factory.mktemp("qwen2") / "tiny"
    model.save_pretrained(path)
    return path


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the engine dispatches to this kernel by itself")
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_model_on_this_kernel_gives_the_cpu_path_tokens(tiny_qwen2, method, monkeypatch):
    """The model quantized at load, its linears on this kernel (the rest as the CPU dispatches it), gives
    the greedy tokens of the CPU's own quantized path: prefill chunks, decode rows and 3-D inputs."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 17, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_qwen2), quantization=method, max_num_batched_tokens=32, num_kv_blocks=32)
    expected = run_engine(EngineCore(config), prompts, params)

    cpu_choice = ops.implementation
    monkeypatch.setattr(
        ops,
        "implementation",
        lambda name, device: tri.quantized_linear if name == "quantized_linear" else cpu_choice(name, device),
    )
    assert run_engine(EngineCore(config), prompts, params) == expected
