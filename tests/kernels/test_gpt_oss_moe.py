"""gpt-oss's mixture of experts through the reference `fused_moe` (kernels/torch_ref/moe.py) and its keyword
options: top-k logits then a softmax over them (`Routing.softmax_after_topk`), expert biases and the clamped
SwiGLU, against Hugging Face's `GptOssMLP` itself; MXFP4 expert storage through the same op; and the
Triton entry handing all of that to the reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import mxfp4
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.torch_ref.moe import ClampedSwiGLU, Routing, fused_moe, route


def _hf_mlp(seed: int = 0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, swiglu_limit=1.5
    )
    torch.manual_seed(seed)
    mlp = GptOssMLP(config).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)  # (biases too; a small limit so that the clamps bite)
    return config, mlp


def _ours(mlp):
    """Our layout of HF's experts: w13 [E, 2I, H] gate rows then up rows (HF interleaves them), w2 [E, H, I]."""
    experts = mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], interleaved rows
    w13 = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1).contiguous()
    b = experts.gate_up_proj_bias.detach()
    w13_bias = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()
    return w13, w13_bias, w2, experts.down_proj_bias.detach()


def test_routing_is_a_softmax_over_the_top_k_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False, softmax_after_topk=True)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), dim=-1))


def test_fused_moe_with_gpt_oss_options_equals_hfs_mlp():
    config, mlp = _hf_mlp()
    hidden = torch.randn(11, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = mlp(hidden[None])
        logits = torch.nn.functional.linear(hidden, mlp.router.weight, mlp.router.bias)
    w13, w13_bias, w2, w2_bias = _ours(mlp)
    routing = Routing(2, weights_in_hidden_dtype=True, softmax_after_topk=True)
    activation = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
    got = fused_moe(hidden, logits, w13, w2, routing, w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    # (the options matter: without the clamp, or the biases, the result is another)
    loose = ClampedSwiGLU(config.swiglu_alpha, 1e9)
    assert not torch.allclose(
        fused_moe(hidden, logits, w13, w2, routing, w13_bias=w13_bias, w2_bias=w2_bias, activation=loose),
        want[0],
        atol=1e-3,
    )


def test_mxfp4_experts_run_as_their_dequantized_weights():
    _, mlp = _hf_mlp(seed=2)
    w13, w13_bias, w2, w2_bias = _ours(mlp)
    stored = []
    for dense in (w13, w2):
        experts, rows, cols = dense.shape
        packed = Mxfp4Experts(experts, rows, cols, torch.float32)
        blocks, scales = mxfp4.quantize(dense)
        packed.blocks.copy_(blocks)
        packed.scales.copy_(scales)
        stored.append(packed)
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(4))
    routing = Routing(2, softmax_after_topk=True)
    options = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=ClampedSwiGLU(1.702, 7.0))
    got = fused_moe(hidden, logits, stored[0], stored[1], routing, **options)  # type: ignore[arg-type]
    want = fused_moe(hidden, logits, stored[0].dequantized(), stored[1].dequantized(), routing, **options)
    assert torch.equal(got, want)


def test_the_triton_entry_runs_the_reference_for_gpt_oss():
    """With keyword options, or gpt-oss's routing alone, the Triton fused MoE returns the reference's result
    (before any launch: this runs on the CPU too)."""
    pytest.importorskip("triton")
    from pagoda.kernels.triton import moe as triton_moe

    _, mlp = _hf_mlp(seed=5)
    w13, w13_bias, w2, w2_bias = _ours(mlp)
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(6))
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(7))
    routing = Routing(2, softmax_after_topk=True)
    options = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=ClampedSwiGLU(1.702, 7.0))
    for kwargs in (options, {}):
        want = fused_moe(hidden, logits, w13, w2, routing, **kwargs)
        assert torch.equal(triton_moe.fused_moe(hidden, logits, w13, w2, routing, **kwargs), want)
