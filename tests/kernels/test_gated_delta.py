"""Gated DeltaNet's ops (Qwen3.5/3.6's linear attention): the torch reference against Hugging Face's own
functions (transformers' qwen3_5 modeling), its chunked form against its recurrent form in float64, and the C
kernel (every instruction-set build this machine runs) and the Triton kernel (the interpreter on the CPU,
compiled where there is a GPU) against the reference in float32. HF's delta-rule functions compute in float32
whatever they are given, so the reference meets them in float32; its conv1d meets HF's in float64.

Batches are varlen: lengths of one token (decode), a chunk's edges (63, 64, 65: the reference's chunks are 64
tokens), more than two chunks, and an empty sequence. q, k and v are strided views of one fused tensor, as
the model splits the conv1d's output. States start random (a sequence carried over from an earlier step),
slots are out of order, and the pool has slots nobody names, which must stay exactly as they were.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from pagoda.kernels import ops
from pagoda.kernels.cpu import gated_delta as cpu_gated_delta
from pagoda.kernels.torch_ref import gated_delta as ref
from tests.kernels import isa_variants
from tests.kernels.devices import DEVICE

LENS = [1, 63, 0, 64, 65, 1, 150]
F32 = dict(atol=2e-5, rtol=2e-4)


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor
    state_slots: torch.Tensor

    def args(self) -> tuple:
        return self.query, self.key, self.value, self.g, self.beta

    def sequence(self, index: int) -> tuple:
        """Sequence `index`'s q, k, v, g, beta with HF's batch dimension in front."""
        start, end = self.cu_seqlens[index], self.cu_seqlens[index + 1]
        return tuple(x[None, start:end] for x in self.args())


def make_batch(lens: list[int], key_heads: int, value_heads: int, key_dim: int, value_dim: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    key_size, value_size = key_heads * key_dim, value_heads * value_dim
    fused = torch.randn(tokens, 2 * key_size + value_size + 3, generator=gen)  # (+3: a token stride of its own)
    query = fused[:, :key_size].view(tokens, key_heads, key_dim)
    key = fused[:, key_size : 2 * key_size].view(tokens, key_heads, key_dim)
    value = fused[:, 2 * key_size : 2 * key_size + value_size].view(tokens, value_heads, value_dim)
    # g and beta as the layer makes them: decays in (0, 1], most near 1, some strong.
    a, b = torch.randn(tokens, value_heads, generator=gen), torch.randn(tokens, value_heads, generator=gen)
    a_log = torch.empty(value_heads).uniform_(-3, 1, generator=gen)
    g, beta = ref.gdn_gating(a, b, a_log, torch.randn(value_heads, generator=gen))
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    slots = torch.randperm(len(lens) + 3, generator=gen)[: len(lens)]  # (3 slots nobody names)
    return Batch(query, key, value, g, beta, cu_seqlens, slots)


def make_states(batch: Batch, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    value_heads, value_dim = batch.value.shape[1:]
    slots = len(batch.state_slots) + 3
    return (0.3 * torch.randn(slots, value_heads, batch.key.shape[2], value_dim, generator=gen)).to(dtype)


def _on_device(fn):
    """`fn` run on DEVICE (the GPU where there is one, else the interpreter on the CPU): the arguments moved
    there, the states it updates copied back, its output brought back to the CPU."""

    def call(*args, **kwargs):
        moved = [arg.to(DEVICE) if isinstance(arg, torch.Tensor) else arg for arg in args]
        out = fn(*moved, **kwargs)
        for arg, there in zip(args, moved, strict=True):
            if there is not arg:
                arg.copy_(there)
        return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()

    return call


def _triton_rule():
    pytest.importorskip("triton")
    from pagoda.kernels.triton import gated_delta

    return _on_device(gated_delta.gated_delta_rule)


def _triton_conv():
    pytest.importorskip("triton")
    from pagoda.kernels.triton import gated_delta

    return _on_device(gated_delta.causal_conv1d)


RULES = {
    "reference": lambda: ref.gated_delta_rule,
    "recurrent reference": lambda: ref.gated_delta_rule_recurrent,
    "C": lambda: cpu_gated_delta.gated_delta_rule,
    "Triton": _triton_rule,
}
CONVS = {"reference": lambda: ref.causal_conv1d, "C": lambda: cpu_gated_delta.causal_conv1d, "Triton": _triton_conv}
# Triton's interpreter runs a program's tokens one at a time in Python: shorter sequences, smaller heads.
SMALL_LENS = [1, 5, 0, 17, 1]


def _untouched(states: torch.Tensor, before: torch.Tensor, batch: Batch) -> None:
    named = set(batch.state_slots.tolist())
    for slot in range(states.shape[0]):
        if slot not in named:
            assert torch.equal(states[slot], before[slot]), f"slot {slot} is no sequence's, yet it changed"


@pytest.mark.parametrize("key_heads, value_heads", [(2, 4), (3, 3)])
def test_reference_is_hf_per_sequence(key_heads, value_heads):
    """HF's chunked function for prompts, its recurrent one for single tokens (as its layer picks them)."""
    batch = make_batch(LENS, key_heads, value_heads, key_dim=32, value_dim=16, seed=1)
    states = make_states(batch)
    before = states.clone()
    out = ref.gated_delta_rule(*batch.args(), states, batch.cu_seqlens, batch.state_slots)
    for index, slot in enumerate(batch.state_slots.tolist()):
        start, end = batch.cu_seqlens[index], batch.cu_seqlens[index + 1]
        if end == start:
            assert torch.equal(states[slot], before[slot])
            continue
        hf_rule = hf.torch_recurrent_gated_delta_rule if end - start == 1 else hf.torch_chunk_gated_delta_rule
        expected, state = hf_rule(
            *batch.sequence(index),
            initial_state=before[slot][None].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[start:end], expected[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(states[slot], state[0], atol=1e-6, rtol=1e-5)
    _untouched(states, before, batch)


def test_chunked_and_recurrent_forms_agree_in_float64():
    batch = make_batch(LENS, 2, 4, key_dim=32, value_dim=16, seed=2)
    batch.query, batch.key, batch.value = (x.double() for x in (batch.query, batch.key, batch.value))
    chunked_states, recurrent_states = make_states(batch, torch.float64), make_states(batch, torch.float64)
    chunked = ref.gated_delta_rule(*batch.args(), chunked_states, batch.cu_seqlens, batch.state_slots)
    recurrent = ref.gated_delta_rule_recurrent(*batch.args(), recurrent_states, batch.cu_seqlens, batch.state_slots)
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(chunked, recurrent, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(chunked_states, recurrent_states, atol=1e-11, rtol=1e-10)


@pytest.mark.parametrize("name", ["C", "Triton"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_kernels_match_the_reference(name, use_qk_l2norm):
    if name == "Triton":
        batch = make_batch(SMALL_LENS, 2, 4, key_dim=16, value_dim=40, seed=3)  # (Dv: 2 blocks, one partial)
    else:
        batch = make_batch(LENS, 2, 4, key_dim=128, value_dim=128, seed=3)  # (Qwen3.5's head dims)
    if not use_qk_l2norm:  # (long keys make the delta rule unstable: |k|^2 about 0.5 keeps it contracting)
        shrink = 0.7 * batch.key.shape[2] ** -0.5
        batch.query, batch.key = batch.query * shrink, batch.key * shrink
    expected_states, states = make_states(batch), make_states(batch)
    before = states.clone()
    expected = ref.gated_delta_rule(
        *batch.args(), expected_states, batch.cu_seqlens, batch.state_slots, use_qk_l2norm=use_qk_l2norm
    )
    out = RULES[name]()(*batch.args(), states, batch.cu_seqlens, batch.state_slots, use_qk_l2norm=use_qk_l2norm)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **F32)
    torch.testing.assert_close(states, expected_states, **F32)
    _untouched(states, before, batch)


@pytest.mark.parametrize("name", list(RULES))
def test_prefill_then_decode_is_one_prefill(name):
    """A prompt's prefix in one call, then its tokens one decode step at a time (the batch shrinking as
    sequences run out), gives the outputs and states of the whole prompt at once."""
    lens, prefix = ([6, 3, 1], [4, 1, 1]) if name == "Triton" else ([70, 9, 2], [64, 1, 1])
    batch = make_batch(lens, 1, 2, key_dim=16, value_dim=16, seed=4)
    rule = RULES[name]()
    whole_states, states = make_states(batch), make_states(batch)
    whole = ref.gated_delta_rule(*batch.args(), whole_states, batch.cu_seqlens, batch.state_slots)
    starts = batch.cu_seqlens[:-1]
    rows = torch.cat([torch.arange(start, start + n) for start, n in zip(starts.tolist(), prefix, strict=True)])
    out = torch.full_like(batch.value, float("nan"))
    prefix_cu = torch.tensor([0, *prefix]).cumsum(0)
    out[rows] = rule(*(x[rows] for x in batch.args()), states, prefix_cu, batch.state_slots)
    for step in range(max(lens) - min(prefix)):
        live = [i for i in range(len(lens)) if prefix[i] + step < lens[i]]
        if not live:
            break
        token_rows = torch.tensor([starts[i] + prefix[i] + step for i in live])
        step_cu = torch.arange(len(live) + 1)
        out[token_rows] = rule(*(x[token_rows] for x in batch.args()), states, step_cu, batch.state_slots[live])
    torch.testing.assert_close(out, whole, **F32)
    torch.testing.assert_close(states, whole_states, **F32)


def _conv_batch(lens: list[int], channels: int, width: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    x = torch.randn(tokens, channels + 5, generator=gen, dtype=dtype)[:, :channels]  # (a token stride of its own)
    weight = torch.randn(channels, width, generator=gen, dtype=dtype)
    bias = torch.randn(channels, generator=gen, dtype=dtype)
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    slots = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)]
    states = torch.randn(len(lens) + 2, width - 1, channels, generator=gen, dtype=dtype)
    return x, weight, bias, states, cu_seqlens, slots


@pytest.mark.parametrize("width", [4, 2])
def test_conv1d_reference_is_hf_in_float64(width):
    """HF's causal_conv1d_update (a state, any number of new tokens) and, from a zero state,
    causal_conv1d_fn (prefill), with SiLU; HF's state is [C, K - 1] where ours is [K - 1, C]."""
    lens = [1, 2, 0, 3, 40]
    x, weight, bias, states, cu_seqlens, slots = _conv_batch(lens, 24, width, seed=5, dtype=torch.float64)
    before = states.clone()
    out = ref.causal_conv1d(x, weight, bias, states, cu_seqlens, slots)
    assert out.dtype == torch.float64
    for index, slot in enumerate(slots.tolist()):
        start, end = cu_seqlens[index], cu_seqlens[index + 1]
        if end == start:
            assert torch.equal(states[slot], before[slot])
            continue
        hf_state = before[slot].t()[None].clone()
        expected = hf.causal_conv1d_update(x[None, start:end].transpose(1, 2), hf_state, weight, bias, "silu")
        torch.testing.assert_close(out[start:end], expected[0].t(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(states[slot], hf_state[0].t(), atol=0, rtol=0)
    zero = torch.zeros_like(states)
    from_zero = ref.causal_conv1d(x, weight, None, zero, cu_seqlens, slots, activation=None)
    start, end = cu_seqlens[-2], cu_seqlens[-1]
    expected = hf.causal_conv1d_fn(x[None, start:end].transpose(1, 2), weight, None, activation=None)
    torch.testing.assert_close(from_zero[start:end], expected[0].t(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["C", "Triton"])
@pytest.mark.parametrize("with_bias, activation", [(True, "silu"), (False, None)])
def test_conv1d_kernels_match_the_reference(name, with_bias, activation):
    lens = [1, 2, 0, 3, 9] if name == "Triton" else [1, 2, 0, 3, 70]
    x, weight, bias, states, cu_seqlens, slots = _conv_batch(lens, 300, 4, seed=6)  # (past one 256-channel block)
    bias = bias if with_bias else None
    expected_states, before = states.clone(), states.clone()
    expected = ref.causal_conv1d(x, weight, bias, expected_states, cu_seqlens, slots, activation)
    out = CONVS[name]()(x, weight, bias, states, cu_seqlens, slots, activation)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(states, expected_states)  # (copied, never computed)
    for slot in set(range(states.shape[0])) - set(slots.tolist()):
        assert torch.equal(states[slot], before[slot])


@pytest.mark.parametrize("name", list(CONVS))
def test_conv1d_decode_steps_are_one_prefill(name):
    x, weight, bias, states, cu_seqlens, slots = _conv_batch([7, 2], 16, 4, seed=7)
    conv = CONVS[name]()
    whole_states = states.clone()
    whole = ref.causal_conv1d(x, weight, bias, whole_states, cu_seqlens, slots)
    out = torch.full_like(whole, float("nan"))  # (rows 0..1 of the first sequence and the second's 7..8 at once)
    out[[0, 1, 7, 8]] = conv(x[[0, 1, 7, 8]], weight, bias, states, torch.tensor([0, 2, 4]), slots)
    for row in range(2, 7):  # (the first sequence alone, a token at a time)
        out[row] = conv(x[row : row + 1], weight, bias, states, torch.tensor([0, 1]), slots[:1])[0]
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, whole_states, atol=0, rtol=0)


def test_gating_and_gated_norm_match_hf():
    gen = torch.Generator().manual_seed(8)
    tokens, heads, dim = 9, 6, 32
    fused = torch.randn(tokens, 2 * heads + 1, generator=gen) * 6  # (softplus past its linear threshold, 20)
    a, b = fused[:, :heads], fused[:, heads : 2 * heads]
    a_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen) * 5
    g, beta = ref.gdn_gating(a, b, a_log, dt_bias)
    # HF's layer, as written in Qwen3_5GatedDeltaNet.forward
    torch.testing.assert_close(g, -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())
    c_g, c_beta = cpu_gated_delta.gdn_gating(a, b, a_log, dt_bias)
    torch.testing.assert_close(c_g, g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_beta, beta, atol=1e-6, rtol=1e-5)

    norm = hf.Qwen3_5RMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    x, z = torch.randn(tokens * heads, dim, generator=gen), torch.randn(tokens * heads, dim, generator=gen)
    expected = norm(x, z).detach()
    torch.testing.assert_close(ref.rms_norm_gated(x, z, norm.weight.detach(), 1e-6), expected, atol=0, rtol=0)
    ours = cpu_gated_delta.rms_norm_gated(x, z, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    # [T, Hv, Dv] with z a view of a fused projection (a token stride of its own), as the layer has it
    fused_z = torch.randn(tokens, heads * dim + 7, generator=gen)
    z_heads, x_heads = fused_z[:, : heads * dim].view(tokens, heads, dim), x.view(tokens, heads, dim)
    expected = norm(x_heads, z_heads).detach()
    torch.testing.assert_close(ops.rms_norm_gated(x_heads, z_heads, norm.weight.detach(), 1e-6), expected, **F32)
    bf16 = (x.bfloat16(), z.bfloat16(), norm.weight.detach().bfloat16())
    torch.testing.assert_close(ref.rms_norm_gated(*bf16, 1e-6), norm.bfloat16()(*bf16[:2]).detach(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gating_and_gated_norm_match_the_reference(dtype):
    """fp32 closely; bf16 within an ulp or two (the interpreter truncates where the GPU rounds)."""
    pytest.importorskip("triton")
    from pagoda.kernels.triton import gated_delta as triton_gated_delta

    tolerance = F32 if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    gen = torch.Generator().manual_seed(15)
    tokens, heads, dim = 5, 6, 40  # (neither a power of two)
    fused = (torch.randn(tokens, 2 * heads + 3, generator=gen) * 8).to(dtype)  # (softplus past 20 and below -15)
    a, b = fused[:, :heads], fused[:, heads : 2 * heads]
    a_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen).to(dtype)
    g, beta = _on_device(triton_gated_delta.gdn_gating)(a, b, a_log, dt_bias)
    expected_g, expected_beta = ref.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, expected_g, **F32)
    torch.testing.assert_close(beta, expected_beta, **tolerance)

    x = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    z = torch.randn(tokens, heads * dim + 7, generator=gen).to(dtype)[:, : heads * dim].view(tokens, heads, dim)
    weight = torch.randn(dim, generator=gen).to(dtype)
    for x_rows, z_rows in ((x, z), (x.view(-1, dim), z.reshape(-1, dim))):
        out = _on_device(triton_gated_delta.rms_norm_gated)(x_rows, z_rows, weight, 1e-6)
        torch.testing.assert_close(out, ref.rms_norm_gated(x_rows, z_rows, weight, 1e-6), **tolerance)


def test_dispatch_picks_the_c_kernels_on_the_cpu():
    cpu = torch.device("cpu")
    for name in ("causal_conv1d", "gated_delta_rule", "gdn_gating", "rms_norm_gated"):
        assert ops.compiled(name, cpu)
        assert ops.implementation(name, cpu).__module__ == "pagoda.kernels.cpu.gated_delta"
    batch = make_batch([3, 1], 1, 2, key_dim=16, value_dim=16, seed=9)
    expected_states, states = make_states(batch), make_states(batch)
    expected = ref.gated_delta_rule(*batch.args(), expected_states, batch.cu_seqlens, batch.state_slots)
    torch.testing.assert_close(
        ops.gated_delta_rule(*batch.args(), states, batch.cu_seqlens, batch.state_slots.int()), expected, **F32
    )
    # bfloat16 inputs are not the kernel's: the reference takes them, and still computes in float32
    bf16 = (batch.query.bfloat16(), batch.key.bfloat16(), batch.value.bfloat16(), batch.g, batch.beta.bfloat16())
    out = ops.gated_delta_rule(*bf16, make_states(batch), batch.cu_seqlens, batch.state_slots)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("gated_delta", tmp_path_factory)


@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
def test_other_instruction_sets_agree(variant_libraries, variant):
    lib = variant_libraries[variant]
    batch = make_batch([1, 65, 2], 2, 4, key_dim=128, value_dim=128, seed=10)
    expected_states, states = make_states(batch), make_states(batch)
    expected = ref.gated_delta_rule(*batch.args(), expected_states, batch.cu_seqlens, batch.state_slots)
    out = cpu_gated_delta._gated_delta_rule(lib, *batch.args(), states, batch.cu_seqlens, batch.state_slots, True)
    torch.testing.assert_close(out, expected, **F32)
    torch.testing.assert_close(states, expected_states, **F32)

    x, weight, bias, conv_states, cu_seqlens, slots = _conv_batch([1, 3, 9], 300, 4, seed=11)
    expected_conv_states = conv_states.clone()
    expected = ref.causal_conv1d(x, weight, bias, expected_conv_states, cu_seqlens, slots)
    out = cpu_gated_delta._causal_conv1d(lib, x, weight, bias, conv_states, cu_seqlens, slots, "silu")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv_states, expected_conv_states)

    gen = torch.Generator().manual_seed(12)
    a, b, a_log, dt_bias = (torch.randn(n, generator=gen) * 4 for n in ((5, 8), (5, 8), 8, 8))
    expected = ref.gdn_gating(a, b, a_log, dt_bias)
    for ours, theirs in zip(cpu_gated_delta._gdn_gating(lib, a, b, a_log, dt_bias), expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    x, z, w = torch.randn(7, 128, generator=gen), torch.randn(7, 128, generator=gen), torch.randn(128, generator=gen)
    for x_rows, z_rows in ((x, z), (x.view(7, 4, 32), z.view(7, 4, 32))):
        ours = cpu_gated_delta._rms_norm_gated(lib, x_rows, z_rows, w[:32] if x_rows.dim() == 3 else w, 1e-6)
        expected = ref.rms_norm_gated(x_rows, z_rows, w[:32] if x_rows.dim() == 3 else w, 1e-6)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def _hf_layer() -> hf.Qwen3_5GatedDeltaNet:
    config = hf.Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(13)
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        layer.dt_bias.normal_()
        layer.norm.weight.normal_()
    return layer


def _layer_from_ops(layer, hidden, conv_states, states, cu_seqlens, state_slots, pick) -> torch.Tensor:
    """HF's Qwen3_5GatedDeltaNet.forward as a model layer calls the ops: one varlen batch, states in pools."""
    tokens = hidden.shape[0]
    key_size = layer.num_k_heads * layer.head_k_dim
    mixed = torch.nn.functional.linear(hidden, layer.in_proj_qkv.weight)
    z = torch.nn.functional.linear(hidden, layer.in_proj_z.weight).view(tokens, layer.num_v_heads, layer.head_v_dim)
    b = torch.nn.functional.linear(hidden, layer.in_proj_b.weight)
    a = torch.nn.functional.linear(hidden, layer.in_proj_a.weight)
    weight = layer.conv1d.weight.squeeze(1)
    qkv = pick("causal_conv1d")(mixed, weight, layer.conv1d.bias, conv_states, cu_seqlens, state_slots, "silu")
    query = qkv[:, :key_size].view(tokens, layer.num_k_heads, layer.head_k_dim)
    key = qkv[:, key_size : 2 * key_size].view(tokens, layer.num_k_heads, layer.head_k_dim)
    value = qkv[:, 2 * key_size :].view(tokens, layer.num_v_heads, layer.head_v_dim)
    g, beta = pick("gdn_gating")(a, b, layer.A_log, layer.dt_bias)
    out = pick("gated_delta_rule")(query, key, value, g, beta, states, cu_seqlens, state_slots)
    out = pick("rms_norm_gated")(out, z, layer.norm.weight, layer.norm.variance_epsilon)
    return torch.nn.functional.linear(out.reshape(tokens, -1), layer.out_proj.weight)


def _triton_op(name: str):
    pytest.importorskip("triton")
    return _on_device(ops._triton(name))


LAYER_OPS = {
    "reference": lambda name: ops._TORCH[name],
    "dispatched": lambda name: getattr(ops, name),  # (the C kernels here)
    "Triton": _triton_op,
}


@pytest.mark.parametrize("kind", list(LAYER_OPS))
@torch.no_grad()
def test_a_layer_built_from_the_ops_is_hf_layer(kind):
    """HF's whole linear-attention layer on each prompt alone (no cache: zero states) against the ops on a
    varlen batch of the prompts: once whole, once as a prefill of a prefix then decode steps of one token."""
    pick = LAYER_OPS[kind]
    layer = _hf_layer()
    # (past a 64-token chunk, but short under Triton's interpreter, which runs a program's tokens in Python)
    lens, prefix = ([1, 9, 5], [1, 6, 2]) if kind == "Triton" else ([1, 70, 5], [1, 66, 2])
    gen = torch.Generator().manual_seed(14)
    hidden = torch.randn(sum(lens), 64, generator=gen)
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    expected = torch.cat([layer(hidden[None, s:e])[0] for s, e in itertools.pairwise(cu_seqlens.tolist())])

    conv_dim = layer.conv1d.weight.shape[0]
    slots = torch.tensor([2, 0, 3])

    def pools() -> tuple[torch.Tensor, torch.Tensor]:
        conv_states = torch.zeros(4, layer.conv_kernel_size - 1, conv_dim)
        return conv_states, torch.zeros(4, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)

    whole = _layer_from_ops(layer, hidden, *pools(), cu_seqlens, slots, pick)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-4)

    conv_states, states = pools()
    out = torch.full_like(expected, float("nan"))
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_seqlens[:-1].tolist(), prefix, strict=True)])
    out[rows] = _layer_from_ops(
        layer, hidden[rows], conv_states, states, torch.tensor([0, *prefix]).cumsum(0), slots, pick
    )
    for step in range(max(lens)):
        live = [i for i in range(len(lens)) if prefix[i] + step < lens[i]]
        if not live:
            break
        token_rows = torch.tensor([cu_seqlens[i] + prefix[i] + step for i in live])
        step_cu = torch.arange(len(live) + 1)
        out[token_rows] = _layer_from_ops(layer, hidden[token_rows], conv_states, states, step_cu, slots[live], pick)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
