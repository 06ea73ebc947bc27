"""Gemma 4's experts in the fused mixture-of-experts op: GeGLU (gelu with the tanh approximation) in place of
SiLU-and-mul, and a scale per expert on each pair's routing weight (`Routing.expert_scales`). The torch
reference equals Hugging Face's Gemma4TextRouter and Gemma4TextExperts; the C kernel (kernels/cpu/moe.c)
equals the reference with the experts as float32 panels or int4 (float and int8 activations), at every
instruction set this machine runs."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.quantization.at_load import quantize_int4_grouped
from pagoda.kernels import cpu
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts, pack
from pagoda.kernels.torch_ref import moe
from tests.kernels import isa_variants

E, H, INTER, TOP_K = 8, 64, 96, 2


def _hf_block(seed: int = 0):
    """HF's router and experts of a tiny Gemma 4 MoE block, their scales drawn so that they matter."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    config = Gemma4TextConfig(
        hidden_size=H, num_experts=E, top_k_experts=TOP_K, moe_intermediate_size=INTER, enable_moe_block=True
    )
    torch.manual_seed(seed)
    router, experts = Gemma4TextRouter(config).eval(), Gemma4TextExperts(config).eval()
    with torch.no_grad():
        for parameter in (router.proj.weight, experts.gate_up_proj, experts.down_proj):
            torch.nn.init.normal_(parameter, std=0.3)
        torch.nn.init.uniform_(router.per_expert_scale, 0.5, 1.5)
    return router, experts


def test_the_reference_is_hfs_router_and_experts():
    router, experts = _hf_block()
    hidden = torch.randn(11, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, weights, ids = router(hidden)
        want = experts(hidden, ids, weights)
        # (HF's router input: its own norm and scale, then the projection; the op takes the logits)
        normed = router.norm(hidden) * router.scale * router.scalar_root_size
        logits = torch.nn.functional.linear(normed, router.proj.weight).float()
    routing = moe.Routing(TOP_K, True, False, expert_scales=router.per_expert_scale.detach())
    got = moe.fused_moe(hidden, logits, experts.gate_up_proj.detach(), experts.down_proj.detach(), routing,
                        activation=moe.GeGLU())  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # (both matter: without the scales, or with SiLU, the result is another)
    plain = moe.Routing(TOP_K, True, False)
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    assert not torch.allclose(moe.fused_moe(hidden, logits, w13, w2, plain, activation=moe.GeGLU()), want, atol=1e-3)
    assert not torch.allclose(moe.fused_moe(hidden, logits, w13, w2, routing), want, atol=1e-3)


def _experts(kind: str, seed: int = 3):
    """(w13, w2) in `kind`'s layout, and as the reference multiplies them."""
    gen = torch.Generator().manual_seed(seed)
    dense13 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    dense2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    if kind == "float32":
        return (ExpertPanels.pack(dense13), ExpertPanels.pack(dense2)), (dense13, dense2)
    stacks = []
    for dense in (dense13, dense2):
        shards = [quantize_int4_grouped(matrix, 32) for matrix in dense]
        stacks.append(PackedExperts.stack("experts", [pack(s.q, s.scales, s.mins, 4, 32) for s in shards]))
    return tuple(stacks), tuple(torch.stack([s.matrix(e) for e in range(E)]) for s in stacks)


def _inputs(tokens: int):
    gen = torch.Generator().manual_seed(10 + tokens)
    routing = moe.Routing(TOP_K, True, False, expert_scales=torch.rand(E, generator=gen) + 0.5)
    return torch.randn(tokens, H, generator=gen) * 2, torch.randn(tokens, E, generator=gen) * 2, routing


@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the C kernels do not build")
@pytest.mark.parametrize(("kind", "int8"), [("float32", False), ("int4", False), ("int4", True)])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_c_kernel_computes_the_reference(kind, int8, tokens, monkeypatch):
    """Int8 activations (quantized experts, where this CPU has VNNI) round each row per 32 columns: the
    reference then within the rounding's reach, which the float activations are well inside of."""
    monkeypatch.setattr(cpu.settings, "int8_activations", int8)
    (w13, w2), dense = _experts(kind)
    hidden, logits, routing = _inputs(tokens)
    got = cpu.fused_moe(hidden, logits, w13, w2, routing, activation=moe.GeGLU())
    want = moe.fused_moe(hidden, logits, *dense, routing, activation=moe.GeGLU())
    tolerance = 0.05 * want.abs().max().item() if int8 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=1e-5 if not int8 else 0.05)


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    return isa_variants.build_all("moe", tmp_path_factory)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the C kernels do not build")
@pytest.mark.parametrize("variant", [name for name, _ in isa_variants.variants()])
def test_every_instruction_set_computes_geglu(variant_libraries, variant):
    """moe.c built for each instruction set this machine runs (the vector GeGLU, eight lanes at a time: I = 96
    is twelve of them)."""
    (w13, w2), dense = _experts("float32")
    hidden, logits, routing = _inputs(7)
    got = cpu_moe._fused_moe(variant_libraries[variant], hidden, logits, w13, w2, routing, activation=moe.GeGLU())
    want = moe.fused_moe(hidden, logits, *dense, routing, activation=moe.GeGLU())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
