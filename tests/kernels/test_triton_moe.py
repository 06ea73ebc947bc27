"""The Triton fused mixture-of-experts op (kernels/triton/moe.py) against the torch reference, on the CPU
through Triton's interpreter (compiled on a GPU by benchmarks/gpu_check.sh), and its kernels compiled for
sm_90 without a GPU.

Shapes are tiny and odd (H = 40, I = 24: ragged K and N tiles). Token counts cover none, one, a batch
taking the 16-row blocks, and batches where one expert fills more than one block of either size.
Outputs and intermediates are NaN-poisoned while the op runs, so an element it fails to write, or a
padding row or another rank's pair it reads, shows up as NaN.

The kernel rounds to the hidden dtype where the reference rounds, so fp16 and bf16 results equal the
reference's up to the GEMMs' summation order, which may flip a rare rounding: under 1% of the elements
differ, by at most one rounding of the largest output. For bf16 that needs two things from the
interpreter it lacks: its fp32 -> bf16 casts truncate (the GPU rounds to
nearest even), which `bf16_rounds_to_nearest` corrects here, and its bf16 `tl.dot` is wrong, which the
kernel avoids under the interpreter (`_dot`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from pagoda.kernels.torch_ref import moe as ref
from pagoda.kernels.triton import moe as tri
from tests import tiny_models
from tests.helpers import run_engine
from tests.kernels.devices import DEVICE, make_generator
from tests.kernels.moe_sm90 import SHARED_MEMORY_LIMIT
from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.usefixtures("on_device", "bf16_rounds_to_nearest")

E, H, INTER = 6, 40, 24
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Largest error allowed, relative to the largest output: float32's accumulation error, else one rounding.
TOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.fixture
def bf16_rounds_to_nearest(monkeypatch):
    """Under the interpreter: fp32 -> bf16 conversions round to nearest even, as on the GPU (torch's
    conversion), instead of truncating."""
    if DEVICE != "cpu":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if (input_dtype, output_dtype) != (tl.float32, tl.bfloat16):
            return truncating(values, input_dtype, output_dtype, rounding_mode)
        rounded = torch.from_numpy(np.ascontiguousarray(values).view(np.float32)).to(torch.bfloat16)
        return rounded.view(torch.int16).numpy().view(np.uint16)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def _inputs(tokens: int, dtype: torch.dtype, seed: int, experts: int = E, routed_experts: int | None = None):
    """hidden [T, H], float32 logits [T, routed_experts], w13 and w2 of `experts` experts."""
    gen = make_generator(seed)
    hidden = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, routed_experts or experts, generator=gen) * 2
    w13 = (torch.randn(experts, 2 * INTER, H, generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(experts, H, INTER, generator=gen) * INTER**-0.5).to(dtype)
    return hidden, logits, w13, w2


def _check(hidden, logits, w13, w2, routing, **options) -> torch.Tensor:
    with poisoned_empty():
        got = tri.fused_moe(hidden, logits, w13, w2, routing, **options)
    expected = ref.fused_moe(hidden, logits, w13, w2, routing, **options)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert not got.isnan().any(), "NaN in the kernel's output"
    if expected.numel():
        error = (got.float() - expected.float()).abs().max().item()
        assert error <= TOL[hidden.dtype] * expected.float().abs().max().item(), error
        if hidden.dtype != torch.float32:
            assert (got != expected).float().mean() < 0.01, "the 16-bit roundings differ from the reference's"
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("weights_in_hidden_dtype", [True, False])
def test_matches_reference(dtype, top_k, renormalize, weights_in_hidden_dtype):
    hidden, logits, w13, w2 = _inputs(7, dtype, seed=top_k)
    _check(hidden, logits, w13, w2, ref.Routing(top_k, renormalize, weights_in_hidden_dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 3, 70])
def test_token_counts(dtype, tokens):
    # 70 tokens x 4 = 280 pairs take the 64-row blocks; over 6 experts some expert gets more than 64.
    hidden, logits, w13, w2 = _inputs(tokens, dtype, seed=tokens)
    routing = ref.Routing(4, True)
    _check(hidden, logits, w13, w2, routing)
    if tokens == 70:
        block_m = tri._block_sizes(tokens * 4, E, dtype)[0]
        block_expert = tri._group_pairs(logits, routing, E, block_m)[3]
        assert block_m == 64 and torch.bincount(block_expert).max() > 1, "no expert took two blocks"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_expert_over_several_small_blocks(dtype):
    """Every token picks expert 2 first: 20 pairs in 16-row blocks, the second block partly padding."""
    hidden, logits, w13, w2 = _inputs(20, dtype, seed=5)
    logits[:, 2] += 100
    routing = ref.Routing(1, False)
    assert tri._block_sizes(20, E, dtype)[0] == 16
    _check(hidden, logits, w13, w2, routing)
    assert (tri._group_pairs(logits, routing, E, 16)[3] == 2).sum() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset,local", [(0, 3), (2, 3), (5, 3)])
def test_expert_parallel_counts_only_this_ranks_experts(dtype, offset, local):
    """Routing over 8 experts, this rank holding `local` of them from `offset` (5: the last rank, 5..7)."""
    hidden, logits, w13, w2 = _inputs(9, dtype, seed=offset, experts=local, routed_experts=8)
    logits[0, offset : offset + local] -= 100  # token 0 chooses none of this rank's experts: zeros
    got = _check(hidden, logits, w13, w2, ref.Routing(2, True, True, expert_offset=offset, local_experts=local))
    assert (got[0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma4s_geglu_and_expert_scales_match_the_reference(dtype, monkeypatch):
    """Gemma 4's experts run in the kernel (not the reference): gelu-tanh gates, each pair's weight times its
    expert's scale."""
    hidden, logits, w13, w2 = _inputs(9, dtype, seed=11)
    scales = torch.rand(E, generator=make_generator(12)) + 0.5
    routing = ref.Routing(2, True, False, expert_scales=scales)
    got = _check(hidden, logits, w13, w2, routing, activation=ref.GeGLU())
    assert not torch.allclose(got.float(), ref.fused_moe(hidden, logits, w13, w2, routing).float(), atol=1e-3)
    monkeypatch.setattr(ref, "fused_moe", None)  # (the kernel computes it: the reference is never called)
    assert torch.equal(tri.fused_moe(hidden, logits, w13, w2, routing, activation=ref.GeGLU()), got)


def test_an_unchosen_experts_nan_weights_never_reach_the_output():
    hidden, logits, w13, w2 = _inputs(12, torch.float32, seed=3)
    logits[:, 4] = -100  # no token picks expert 4
    w13[4], w2[4] = float("nan"), float("nan")
    _check(hidden, logits, w13, w2, ref.Routing(2, True))


def test_options_run_the_reference(monkeypatch):
    """Keyword options (gpt-oss: expert biases, a clamped SwiGLU, top-k-then-softmax) go to the reference."""
    calls = []
    monkeypatch.setattr(ref, "fused_moe", lambda *args, **options: calls.append(options) or "reference")
    hidden, logits, w13, w2 = _inputs(2, torch.float32, seed=0)
    assert tri.fused_moe(hidden, logits, w13, w2, ref.Routing(2), swiglu_limit=7.0) == "reference"
    assert calls == [{"swiglu_limit": 7.0}]


def test_packed_experts_run_the_reference(monkeypatch):
    """Experts packed or quantized (kernels/panels.py ExpertPanels, kernels/quantized.py PackedExperts) are
    not the kernel's plain stacked tensors: the reference, which unpacks the chosen ones, computes them."""
    from pagoda.kernels.panels import ExpertPanels

    calls = []
    monkeypatch.setattr(ref, "fused_moe", lambda *args, **options: calls.append(args[2]) or "reference")
    hidden, logits, w13, w2 = _inputs(2, torch.float32, seed=0)
    packed13, packed2 = ExpertPanels.pack(w13.cpu()), ExpertPanels.pack(w2.cpu())
    assert tri.fused_moe(hidden, logits, packed13, packed2, ref.Routing(2)) == "reference"
    assert calls == [packed13]


def test_grouping_reads_nothing_on_the_host():
    """The routing and grouping run on meta tensors, which hold no values (`.item()`, `.tolist()` and
    data-dependent shapes raise there): nothing waits for the GPU, and a CUDA graph can capture the op."""
    routing = ref.Routing(2, True, expert_offset=2, local_experts=4)
    *_, sorted_pairs, block_expert = tri._group_pairs(torch.empty(5, 8, device="meta"), routing, 4, 16)
    assert sorted_pairs.shape == (80,)  # T * k + E * (BLOCK_M - 1) = 70, up to a whole block
    assert block_expert.shape == (sorted_pairs.shape[0] // 16,)


def test_cuda_dispatch_picks_the_triton_kernel(monkeypatch):
    assert ops._resolve.__wrapped__("fused_moe", "cuda") is tri.fused_moe
    monkeypatch.setitem(ops._enabled, "cuda", False)  # (Triton turned off: the reference, on any device)
    assert ops._resolve.__wrapped__("fused_moe", "cuda") is ref.fused_moe


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU check runs MoE models on Triton for real")
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_model_on_the_triton_op_gives_the_torch_tokens(tmp_path, monkeypatch, name):
    """A tiny Qwen3-MoE (a dense layer among the MoE ones) and Qwen2-MoE (a shared expert, weights not
    renormalised), their fused MoE on the Triton kernel, the rest on the CPU path: the reference's greedy
    tokens, eager and through the padded CUDA-graph decode buffers."""
    tiny_models.build(name, vocab_size=256, num_hidden_layers=2).save_pretrained(tmp_path / name)
    monkeypatch.setattr(MoEMLP, "pack_for_cpu", lambda self: False)  # (plain experts, as on CUDA)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tmp_path / name), num_kv_blocks=32, max_model_len=128)
    expected = run_engine(EngineCore(config), prompts, params)

    on_cpu = ops.implementation
    monkeypatch.setattr(
        ops, "implementation", lambda op, device: tri.fused_moe if op == "fused_moe" else on_cpu(op, device)
    )
    assert run_engine(EngineCore(config), prompts, params) == expected
    engine = EngineCore(config)
    engine.runner.enable_decode_graphs(engine.max_model_len, capture=False)
    assert run_engine(engine, prompts, params) == expected


@pytest.mark.slow  # (15 compiles: about 5 s with Triton's cache warm, 15 s cold)
def test_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton's default; set, it stops a warning)
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.moe_sm90"],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 * 7  # (per dtype: gate_up, gate_up_geglu and down at two sizes, and the sum)
    for row in rows:
        assert row["shared"] < SHARED_MEMORY_LIMIT, row
        assert row["spill_stack"] == 0, row  # registers spilled to local memory
