"""gpt-oss (engine_core/models/gpt_oss.py) split over ranks: tensor parallel (attention heads with their
sinks; each expert's intermediate rows, MXFP4 experts' in whole blocks of 32), expert parallel (whole experts
per rank) and pipeline parallel (whole layers per stage, each keeping its own attention kind).

Without processes: each rank's MoE layer is a partial sum of the whole layer's (the down projection's bias
on one rank only), float and MXFP4, with an intermediate size that splits evenly (64) and one whose MXFP4
blocks do not (96: 3 blocks, 32 + 64 rows) -- in the fused MoE's C kernel where it builds; each rank's
sinks are its query heads'; a pipeline stage's layers keep their sliding or full attention by their index
in the model; and MXFP4 experts split over more ranks than they have blocks are refused with the limit
named. With real worker processes over gloo: TP=2, EP=2 and PP=2 engines on the tiny float and MXFP4
checkpoints (their attention biases drawn, so that o_proj's, added once after its all-reduce, matters)
generate one rank's greedy tokens on prompts past the 8-token sliding window, and their first-step
logprobs agree within tests/parallel_checks.py TOLERANCE.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.engine_core.loader import load_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.gpt_oss import GptOssMLP
from pagoda.engine_core.parallel.distributed import SINGLE, TPGroup, building_for
from pagoda.engine_core.parallel.sharding import check_model_splits
from pagoda.engine_core.parallel.stage import Stage
from pagoda.kernels import ops
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs
from tests.parallel_checks import compare_runs, random_prompts

# name -> (the gpt_oss tiny model's intermediate size, MXFP4 experts)
CHECKPOINTS = {
    "float": (64, False),
    "mxfp4": (64, True),
    "float-96": (96, False),
    "mxfp4-96": (96, True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, its checkpoint directory), each built once."""
    root = tmp_path_factory.mktemp("gpt-oss-parallel")
    models = {}
    for name, (inter, mxfp4) in CHECKPOINTS.items():
        float_name = name.replace("mxfp4", "float")
        if float_name not in models:
            hf_model = tiny_models.build("gpt_oss", intermediate_size=inter)
            for layer in hf_model.model.layers:  # (HF draws them zero: make o_proj's bias, added once, matter)
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
            hf_model.save_pretrained(root / float_name)
            models[float_name] = hf_model, root / float_name
        if mxfp4:
            hf_model, float_dir = models[float_name]
            tiny_models.save_gpt_oss_mxfp4(hf_model, float_dir, root / name)
            models[name] = hf_model, root / name  # (its HF model holds the float experts)
    return models


def _load(model_dir, group=SINGLE, expert_parallel=False, stage=None):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(
        model_dir, cfg, torch.float32, torch.device("cpu"), group=group, stage=stage, expert_parallel=expert_parallel
    )


def _in_c_only(monkeypatch) -> None:
    """Where the C kernels build (and are on): from here on the fused MoE's torch reference raises if it runs
    (the C op falls back to it for experts it does not read)."""
    if ops.compiled("fused_moe", torch.device("cpu")):
        assert ops.implementation("fused_moe", torch.device("cpu")) is cpu_moe.fused_moe

        def refuse(*args, **kwargs):
            raise AssertionError("the experts ran the torch reference")

        monkeypatch.setattr(cpu_moe.reference, "fused_moe", refuse)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_ranks_partial_sums_add_up_to_the_whole_layer(saved, name, expert_parallel, monkeypatch):
    """Each rank's MoE layer (its all-reduce left out: a group without a process group) computes a partial
    sum, of its rows of every expert or of its experts' pairs; the two ranks' sum is the single-rank layer's
    output in every layer. The down projection's bias, added before each expert's routing weight, joins
    one rank's sum only (both: the sum is off by it)."""
    _, model_dir = saved[name]
    inter, mxfp4 = CHECKPOINTS[name]
    whole = _load(model_dir).decoder_layers()
    ranks = [_load(model_dir, TPGroup(rank, 2), expert_parallel).decoder_layers() for rank in range(2)]
    mlps = [layers[0].mlp for layers in ranks]
    assert all(isinstance(mlp, GptOssMLP) for mlp in mlps)
    layout = Mxfp4Experts if mxfp4 else ExpertPanels
    if ops.compiled("fused_moe", torch.device("cpu")):
        assert all(isinstance(weights, layout) for mlp in mlps for weights in mlp.experts())
    _in_c_only(monkeypatch)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(whole):
        with torch.no_grad():
            expected = layer.mlp(x)
            parts = [layers[i].mlp(x) for layers in ranks]
        assert all(float(part.sub(expected).abs().max()) > 1e-2 for part in parts)  # (each rank holds a share)
        torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-4, rtol=1e-5)
    if expert_parallel:  # (whole experts, 2 of 4 each, with their biases)
        assert [(mlp.routing.expert_offset, mlp.routing.local_experts) for mlp in mlps] == [(0, 2), (2, 2)]
        assert [tuple(mlp.w13_bias.shape) for mlp in mlps] == [(2, 2 * inter)] * 2
        assert all(mlp.w2_bias is not None for mlp in mlps)
    else:
        # MXFP4 splits in whole blocks of 32 rows: 96 rows are 32 + 64 (float: 48 + 48)
        rows = {64: [32, 32], 96: [32, 64] if mxfp4 else [48, 48]}[inter]
        assert [mlp.w13_bias.shape[1] for mlp in mlps] == [2 * r for r in rows]
        assert [mlp.w2_bias is not None for mlp in mlps] == [True, False]


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_query_heads_sinks(saved, world):
    """4 query heads with 2 K/V heads: 2 ranks hold 2 heads each, 4 ranks one each (each K/V head on two)."""
    hf_model, model_dir = saved["float"]
    for rank in range(world):
        model = _load(model_dir, TPGroup(rank, world), expert_parallel=world == 4)
        heads = slice(rank * 4 // world, (rank + 1) * 4 // world)
        for ours, theirs in zip(model.attention_layers(), hf_model.model.layers, strict=True):
            assert ours.sinks is not None and torch.equal(ours.sinks, theirs.self_attn.sinks[heads])


def test_a_pipeline_stage_keeps_each_layers_attention_kind(saved):
    """Each stage's layers take their sliding window (or none) and sinks by their index in the model. Three
    stages of the 4 layers hold 0 | 1 | 2, 3: the second stage's only layer is layer 1 (full attention),
    though it is the stage's first."""
    hf_model, model_dir = saved["float"]
    held = []
    for index in range(3):
        model = _load(model_dir, stage=Stage(index, 3))
        layers = list(model.layer_range)
        held.append(layers)
        assert [a.sliding_window for a in model.attention_layers()] == [8 if i % 2 == 0 else None for i in layers]
        for i, attention in zip(layers, model.attention_layers(), strict=True):
            sinks = hf_model.model.layers[i].self_attn.sinks
            assert attention.sinks is not None and torch.equal(attention.sinks, sinks)
    assert held == [[0], [1], [2, 3]]


def test_mxfp4_experts_split_over_more_ranks_than_blocks_are_refused(saved):
    """64 intermediate rows are 2 MXFP4 blocks of 32: 4 ranks would cut them (float experts split row by
    row). Refused before any worker starts, and by a rank built without that check; expert parallel
    places whole experts instead, 1 of 4 per rank."""
    float_cfg = ModelConfig.from_dir(saved["float"][1])
    cfg = ModelConfig.from_dir(saved["mxfp4"][1])
    message = (
        r"tensor_parallel_size 4 cannot split the MXFP4 experts' intermediate size 64: it splits in whole "
        r"blocks of 32 rows, 2 of them; use at most 2 ranks, or --enable-expert-parallel"
    )
    with pytest.raises(ValueError, match=message):
        check_model_splits(cfg, 4)
    with torch.device("meta"), building_for(TPGroup(1, 4)), pytest.raises(ValueError, match=message):
        model_class(cfg.architecture)(cfg, torch.float32)
    check_model_splits(cfg, 2)
    check_model_splits(cfg, 4, expert_parallel=True)
    check_model_splits(float_cfg, 4)
    check_model_splits(cfg, 1, 4)  # (pipeline stages hold whole layers)


def test_mxfp4_experts_whose_rows_are_not_whole_blocks_are_refused(saved):
    cfg = ModelConfig.from_dir(saved["mxfp4"][1])
    cfg = dataclasses.replace(cfg, intermediate_size=80, moe_intermediate_size=80)
    with pytest.raises(ValueError, match="intermediate size 80 is not a multiple of their blocks of 32"):
        check_model_splits(cfg, 2)


# split -> engine arguments
SPLITS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pp2": dict(pipeline_parallel_size=2),
}
ENGINE_MODELS = ("float", "mxfp4")
NEW_TOKENS = 16


def _run(model_dir, split: dict):
    args = dict(max_num_batched_tokens=48, num_kv_blocks=64, cpu_threads_bind="none")
    return greedy_with_first_logprobs(model_dir, random_prompts(), NEW_TOKENS, **split, **args)


@pytest.fixture(scope="module")
def one_rank(saved):
    """name -> the single-rank engine's (tokens, first-step logprobs) on random_prompts() (1 to 70 tokens:
    past the 8-token sliding window, the longest in two chunks)."""
    return {name: _run(saved[name][1], {}) for name in ENGINE_MODELS}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_split_engines_generate_one_ranks_tokens(saved, one_rank, name, split):
    """Every prompt's greedy tokens equal one rank's; first-step logprobs within TOLERANCE."""
    _, model_dir = saved[name]
    compare_runs([one_rank[name], _run(model_dir, SPLITS[split])], min_identical=len(random_prompts()))
