"""The fused mixture-of-experts op (kernels/torch_ref/moe.py, `ops.fused_moe`): equal to a plain per-token
float64 loop, routing ties resolved as Hugging Face's routers resolve them, and an expert no token chooses
costs nothing (its weights are never read)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import ops
from pagoda.kernels.torch_ref import moe

E, H, INTER = 8, 32, 16


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    return w13, w2


def _per_token_loop(hidden, logits, w13, w2, top_k, renormalize):
    """Each token alone, in float64: softmax, top-k, optional renormalization, sum of its experts."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        x = hidden[t].double()
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            gate, up = (w13[e].double() @ x).split(INTER)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_a_per_token_float64_loop(top_k, renormalize):
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, H, generator=gen)
    logits = torch.randn(37, E, generator=gen) * 2
    got = ops.fused_moe(hidden, logits, w13, w2, moe.Routing(top_k, renormalize))
    assert got.shape == hidden.shape and got.dtype == hidden.dtype
    expected = _per_token_loop(hidden, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-4)  # (float32 vs float64)


def test_no_tokens_gives_an_empty_result():
    w13, w2 = _weights()
    out = ops.fused_moe(torch.empty(0, H), torch.empty(0, E), w13, w2, moe.Routing(2, True))
    assert out.shape == (0, H)


def _hf_router(name: str):
    """Hugging Face's router module of one MoE family, on a tiny config."""
    import transformers

    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        return MixtralTopKRouter(transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2))
    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        config = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True)
        return Qwen3MoeTopKRouter(config)
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = transformers.Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=False)
    return Qwen2MoeTopKRouter(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_ties_pick_the_experts_hf_picks(family):
    """Router rows whose logits tie (equal weights rows, or a row of equal logits) choose HF's experts
    with HF's weights."""
    router = _hf_router(family)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(E, H, generator=gen)
    weight[5] = weight[1]  # experts 1 and 5 always tie
    weight[6] = weight[2] = weight[7]  # 2, 6 and 7 too
    hidden = torch.randn(16, H, generator=gen)
    hidden[3] = 0.0  # every logit equal: all eight tie
    with torch.no_grad():
        router.weight.copy_(weight)
        logits, hf_weights, hf_ids = router(hidden)
    renormalize = family != "qwen2_moe"
    weights, ids = moe.route(logits.float(), 2, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


def test_an_unchosen_expert_costs_nothing():
    """An expert no token routes to is not computed: its weights may be NaN and the result is unchanged,
    whatever its weights hold."""
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, H, generator=gen)
    logits = torch.randn(20, E, generator=gen)
    logits[:, 4] = -1e9  # nobody chooses expert 4
    expected = ops.fused_moe(hidden, logits, w13, w2, moe.Routing(2, True))
    assert not (moe.route(logits, 2, True)[1] == 4).any()
    w13[4], w2[4] = float("nan"), float("nan")
    got = ops.fused_moe(hidden, logits, w13, w2, moe.Routing(2, True))
    assert torch.equal(got, expected)


def test_each_active_expert_runs_once_for_all_its_tokens(monkeypatch):
    """Grouped by expert: one gate/up GEMM per active expert, holding every token that chose it; none for
    an expert no token chose."""
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(30, H, generator=gen)
    logits = torch.randn(30, E, generator=gen)
    logits[:, 6] = -1e9  # nobody chooses expert 6
    calls: list[tuple[int, int]] = []
    linear = F.linear

    def counting(x, w, *args):
        if w.shape == (2 * INTER, H):
            calls.append((x.shape[0], int((w13 == w).all(dim=(1, 2)).nonzero()[0])))
        return linear(x, w, *args)

    monkeypatch.setattr(moe.F, "linear", counting)
    ops.fused_moe(hidden, logits, w13, w2, moe.Routing(2, False))
    _, ids = moe.route(logits, 2, False)
    active = sorted(set(ids.reshape(-1).tolist()))
    assert active == [0, 1, 2, 3, 4, 5, 7]
    assert [e for _, e in calls] == active
    assert [n for n, _ in calls] == [int((ids == e).sum()) for e in active]


def _hf_block(name: str):
    """Hugging Face's whole MoE block (router and experts) of one family, on a tiny config, in bfloat16."""
    import transformers

    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
        return MixtralSparseMoeBlock(config).bfloat16()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True
    )
    return Qwen3MoeSparseMoeBlock(config).bfloat16()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bfloat16_equals_hf_exactly(family):
    """In bfloat16 the op rounds as HF's block does: Qwen's routing weights rounded to bfloat16 before the
    products, Mixtral's kept float32 (`weights_in_hidden_dtype`)."""
    block = _hf_block(family)
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, H, generator=gen).bfloat16()
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen))
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        expected = block(hidden[None])
        expected = expected[0] if isinstance(expected, tuple) else expected
        logits = F.linear(hidden, block.gate.weight).float()
    routing = moe.Routing(2, True, weights_in_hidden_dtype=family != "mixtral")
    got = ops.fused_moe(hidden, logits, w13.bfloat16(), w2.bfloat16(), routing)
    assert torch.equal(got, expected.reshape(got.shape))


def test_expert_parallel_ranks_sum_to_the_whole():
    """Under expert parallel each rank computes only its own experts' pairs (`expert_offset`,
    `local_experts`); the ranks' partial sums add up to the whole layer's output."""
    w13, w2 = _weights()
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(25, H, generator=gen)
    logits = torch.randn(25, E, generator=gen)
    whole = ops.fused_moe(hidden, logits, w13, w2, moe.Routing(3, True))
    parts = []
    for lo, hi in ((0, 3), (3, 8)):
        routing = moe.Routing(3, True, expert_offset=lo, local_experts=hi - lo)
        parts.append(ops.fused_moe(hidden, logits, w13[lo:hi], w2[lo:hi], routing))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=1e-5)
