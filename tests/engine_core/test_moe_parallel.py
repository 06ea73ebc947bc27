"""Mixture-of-experts models split over ranks (engine_core/models/moe.py): tensor parallel (each expert's
intermediate rows split), expert parallel (`enable_expert_parallel`: whole experts per rank) and pipeline
parallel (whole MoE layers per stage).

Without processes: which rank holds which experts, each rank's layer output being its share of the whole
layer's (their sum equals it; Qwen3-MoE, Qwen2-MoE, Mixtral, and splits that do not divide), dummy
weights, and the splits refused up front. With real worker processes
over gloo: tiny Qwen3-MoE (a dense layer among the MoE ones) and Qwen2-MoE (a shared expert) under TP=2,
EP=2 and PP=2 (and EP=2 x PP=2, four processes: slow), whose greedy tokens equal one rank's and HF's,
and whose first-step logprobs agree with one rank's within tests/parallel_checks.py TOLERANCE (1e-4: the
ranks' partial sums add up in another order, and pipelining batches the requests otherwise, two steps in
flight).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.loader import load_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.parallel.distributed import SINGLE, TPGroup, building_for
from pagoda.engine_core.parallel.sharding import check_model_splits, split_experts
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs, hf_greedy
from tests.parallel_checks import compare_runs, random_prompts


def test_experts_are_placed_in_contiguous_ranges_the_first_ranks_holding_the_remainder():
    def placement(experts: int, world: int) -> list[tuple[int, int]]:
        return [(s.start, s.stop) for s in (split_experts(experts, rank, world) for rank in range(world))]

    assert placement(8, 2) == [(0, 4), (4, 8)]
    assert placement(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert placement(60, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 39), (39, 46), (46, 53), (53, 60)]
    assert placement(3, 3) == [(0, 1), (1, 2), (2, 3)]


# name -> (tests/tiny_models.py architecture, what differs)
CHECKPOINTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    # Splits that do not divide: 7 experts over 2 ranks (4 + 3), 63 and 127 intermediate rows (31 + 32, 63 + 64)
    "qwen2_moe-uneven": (
        "qwen2_moe",
        dict(num_experts=7, moe_intermediate_size=63, shared_expert_intermediate_size=127),
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, its checkpoint directory), each built once."""
    root = tmp_path_factory.mktemp("moe-parallel")
    models = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        models[name] = tiny_models.build(arch, **overrides), root / name
        models[name][0].save_pretrained(root / name)
    return models


def _load(model_dir, group=SINGLE, expert_parallel=False, load_format="auto"):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(
        model_dir, cfg, torch.float32, torch.device("cpu"), load_format, group=group, expert_parallel=expert_parallel
    )


def _stacked(mlp: MoEMLP) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (w13, w2) as plain stacked tensors, whether or not the loader packed them for the CPU's C
    kernel (kernels/panels.py ExpertPanels)."""

    def plain(weights):
        if isinstance(weights, torch.Tensor):
            return weights
        return torch.stack([weights.matrix(e) for e in range(weights.num_experts)])

    w13, w2 = mlp.experts()
    return plain(w13), plain(w2)


def test_an_expert_parallel_rank_holds_and_reads_only_its_experts(saved):
    """Rank 1 of 2 holds experts 4-7 of 8, whole (HF's stacked weights of those experts), and routes only
    the pairs of those (Routing.expert_offset / local_experts)."""
    hf_model, model_dir = saved["qwen3_moe"]
    model = _load(model_dir, TPGroup(1, 2), expert_parallel=True)
    mlp = model.decoder_layers()[0].mlp
    assert isinstance(mlp, MoEMLP)
    assert (mlp.routing.expert_offset, mlp.routing.local_experts) == (4, 4)
    hf_experts = hf_model.model.layers[0].mlp.experts
    w13, w2 = _stacked(mlp)
    assert torch.equal(w13, hf_experts.gate_up_proj[4:8])
    assert torch.equal(w2, hf_experts.down_proj[4:8])


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_ranks_partial_sums_add_up_to_the_whole_layer(saved, name, expert_parallel):
    """Each rank's MoE layer (built as a worker builds it, its all-reduce left out: a group without a
    process group) computes a partial sum, its experts' or its rows' plus its share of the shared
    expert; the two ranks' sum is the single-rank layer's output."""
    _, model_dir = saved[name]
    whole = _load(model_dir).decoder_layers()[0].mlp
    ranks = [_load(model_dir, TPGroup(rank, 2), expert_parallel).decoder_layers()[0].mlp for rank in range(2)]
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(x)
        parts = [mlp(x) for mlp in ranks]
    assert all(float(part.sub(expected).abs().max()) > 1e-3 for part in parts)  # (each rank holds a share only)
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-5, rtol=1e-5)
    shapes = [tuple(_stacked(mlp)[0].shape) for mlp in ranks]
    if name == "qwen2_moe-uneven":
        assert shapes == ([(4, 126, 128), (3, 126, 128)] if expert_parallel else [(7, 62, 128), (7, 64, 128)])
    elif not expert_parallel:  # each expert's 64 intermediate rows: 32 per rank
        assert shapes == [(8, 64, 128)] * 2


@pytest.mark.parametrize("flag", ["int8", "int4"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_experts_quantized_at_load_split_over_the_ranks(saved, flag, expert_parallel):
    """`--quantization int8|int4` with the experts split: each rank quantizes what it holds. Whole experts
    per rank (EP) are quantized as on one rank, so the partial sums add up to the single-rank quantized
    layer; split intermediate rows (TP) group their columns otherwise (int8's per-channel scales of the
    down projection span a rank's columns only), so theirs stay within the quantization's error of it."""
    from pagoda.engine_core.quantization import resolve_method

    _, model_dir = saved["qwen2_moe"]
    cfg = ModelConfig.from_dir(model_dir)

    def layer(group=SINGLE):
        method = resolve_method(flag, cfg.raw)
        model = load_model(
            model_dir, cfg, torch.float32, torch.device("cpu"), quantization=method, group=group,
            expert_parallel=expert_parallel,
        )  # fmt: skip
        return model.decoder_layers()[0].mlp

    whole, ranks = layer(), [layer(TPGroup(rank, 2)) for rank in range(2)]
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, parts = whole(x), [mlp(x) for mlp in ranks]
    tolerance = 1e-5 if expert_parallel else 0.05 * float(expected.abs().max())
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=tolerance, rtol=1e-4)


def test_expert_parallel_is_a_no_op_on_one_rank(saved):
    """vLLM's behaviour: the flag without tensor parallel holds every expert, as without it."""
    _, model_dir = saved["qwen2_moe"]
    mlp = _load(model_dir, SINGLE, expert_parallel=True).decoder_layers()[0].mlp
    assert mlp.routing.local_experts is None and _stacked(mlp)[0].shape[0] == 8


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_dummy_weights_fill_each_ranks_share(saved, expert_parallel):
    _, model_dir = saved["qwen2_moe"]
    model = _load(model_dir, TPGroup(1, 2), expert_parallel, load_format="dummy")
    mlp = model.decoder_layers()[0].mlp
    w13, w2 = _stacked(mlp)
    assert w13.shape == ((4, 128, 128) if expert_parallel else (8, 64, 128))
    assert bool(w13.std() > 0) and bool(w2.std() > 0)


def _moe_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=100,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        sliding_window=None,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
    )
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("overrides", "expert_parallel", "message"),
    [
        ({}, True, "places whole experts on the 8 tensor-parallel ranks, but the model has 4 experts"),
        ({}, False, "exceeds the experts' intermediate size 4: use fewer ranks, or --enable-expert-parallel"),
        (dict(moe_intermediate_size=8, shared_expert_intermediate_size=4), False, "shared expert's intermediate"),
    ],
)
def test_moe_splits_that_cannot_work_are_refused_up_front(overrides, expert_parallel, message):
    cfg = _moe_config(**overrides)
    with pytest.raises(ValueError, match=message):
        check_model_splits(cfg, 8, 1, expert_parallel)
    check_model_splits(cfg, 4, 2, expert_parallel)  # (4 ranks: 4 experts, 4 rows each; and two stages)


def test_an_unreduced_row_parallel_linear_refuses_a_bias():
    """(Each rank would add it to its partial sum: N biases in the all-reduced output.)"""
    from pagoda.engine_core.layers.linear import Linear

    with building_for(TPGroup(0, 2)), pytest.raises(ValueError, match="without its all-reduce takes no bias"):
        Linear(64, 32, True, torch.float32, parallel="row", reduce=False)


def test_a_moe_model_builds_under_every_split_a_rank_may_hold(saved):
    """Tensor, expert and pipeline parallel ranks build the model (the refusals of these splits are gone)."""
    from pagoda.engine_core.models import model_class
    from pagoda.engine_core.parallel.stage import Stage

    _, model_dir = saved["qwen2_moe"]
    cfg = ModelConfig.from_dir(model_dir)
    for group, stage, expert_parallel in [
        (TPGroup(0, 2), Stage(), False),
        (TPGroup(1, 2), Stage(), True),
        (SINGLE, Stage(1, 2), False),
    ]:
        with torch.device("meta"), building_for(group, stage, expert_parallel):
            model = model_class(cfg.architecture)(cfg, torch.float32)
        assert all(isinstance(layer.mlp, MoEMLP) for layer in model.decoder_layers())


# split -> engine arguments
SPLITS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pp2": dict(pipeline_parallel_size=2),
    "ep2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
}
ENGINE_MODELS = ("qwen3_moe", "qwen2_moe")
SLOW = {"ep2xpp2"}  # (four processes on the test host's cores)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def one_rank(saved):
    """name -> the single-rank engine's (tokens, first-step logprobs) on random_prompts(), which equal HF's."""
    runs = {}
    for name in ENGINE_MODELS:
        hf_model, model_dir = saved[name]
        runs[name] = _run(model_dir, {})
        expected = [hf_greedy(hf_model, prompt, NEW_TOKENS, stop_at_eos=False) for prompt in random_prompts()]
        assert runs[name][0] == expected
    return runs


def _run(model_dir, split: dict):
    args = dict(max_num_batched_tokens=48, num_kv_blocks=64, cpu_threads_bind="none")
    return greedy_with_first_logprobs(model_dir, random_prompts(), NEW_TOKENS, **split, **args)


@pytest.mark.parametrize("split", [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in SPLITS])
@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_split_engines_generate_one_ranks_tokens(saved, one_rank, name, split):
    """Every prompt's greedy tokens equal one rank's (and so HF's); first-step logprobs within TOLERANCE."""
    _, model_dir = saved[name]
    runs = [one_rank[name], _run(model_dir, SPLITS[split])]
    compare_runs(runs, min_identical=len(random_prompts()))
