"""Gemma 4, text (engine_core/models/gemma4.py), on tests/tiny_models.py's gemma4: six layers whose last two read
the K/V of earlier layers, full layers with wider heads (one K/V head whose values are its keys) and
proportional rope, per-layer inputs, layer scalars, an 8-token sliding window. Greedy tokens equal HF's (float32,
eager attention) for prompts longer than the window, whole, under chunked prefill and with prefix caching;
first-step logprobs close to HF's; what Gemma 4 adds changes the tokens when undone; the KV pool keeps a group
per K/V shape (two shapes, 32 and 48 elements a row: a pool row of 96, the groups seeing 3 and 2 blocks in
each), the KV-shared layers none; int8 at load; TP=2; a Gemma4ForConditionalGeneration checkpoint serves its
text model; what is not supported is refused clearly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine
from tests.parallel_checks import compare_runs
from tests.quantization_helpers import identical_count, write_dequantized_checkpoint

NEW_TOKENS = 16
LENGTHS = (1, 6, 17, 40)  # (one token, inside the 8-token window, past it)
LOGPROB_ATOL = 1e-4  # (as tests/engine_core/test_gemma.py)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its checkpoint directory, HF's greedy tokens for `_prompts()`)."""
    model = tiny_models.build("gemma4")
    out = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(out)
    expected = [hf_greedy(model, p, NEW_TOKENS, stop_at_eos=False) for p in _prompts()]
    return model, out, expected


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LENGTHS]


def _engine(model_dir, **args) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **args}))


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return run_engine(engine, prompts, params)


def test_the_layers_and_the_kv_pool_are_as_the_config_says(saved):
    """Windows, K/V shapes and sources per layer; the pool's groups: one per sliding layer that keeps K/V and
    one for the full layer, the KV-shared layers bound to their sources' caches and writing none."""
    _, model_dir, _ = saved
    engine = _engine(model_dir)
    model, layout = engine.runner.model, engine.runner.kv_layout
    attention = model.attention_layers()
    assert [a.sliding_window for a in attention] == [8, 8, None, 8, 8, None]
    assert [(a.num_kv_heads, a.head_dim) for a in attention] == [(2, 16)] * 2 + [(1, 48)] + [(2, 16)] * 2 + [(1, 48)]
    assert model.kv_sources() == [0, 1, 2, 3, 3, 2]
    assert all(a.scale == 1.0 for a in attention)
    assert sorted(layer for group in layout.groups for layer in group.layers) == [0, 1, 2, 3]
    assert layout.row_elements == 96
    assert {group.shape: layout.block_scale(g) for g, group in enumerate(layout.groups)} == {(2, 16): 3, (1, 48): 2}
    assert [a.writes_kv for a in attention] == [True] * 4 + [False] * 2
    assert attention[4].key_cache.data_ptr() == attention[3].key_cache.data_ptr()
    assert attention[5].value_cache.data_ptr() == attention[2].value_cache.data_ptr()
    assert engine.runner.kv_cache.shape == (1, 2, 64, 16 * 96)  # (slots, keys and values, blocks, block x row)


def test_greedy_matches_hf(saved):
    _, model_dir, expected = saved
    assert _greedy(_engine(model_dir), _prompts()) == expected


def test_greedy_matches_hf_chunked(saved):
    """The longest prompts split into 16-token chunks (paged prefill over the cached earlier chunks, which the
    KV-shared layers read from their sources' blocks)."""
    _, model_dir, expected = saved
    assert _greedy(_engine(model_dir, max_num_batched_tokens=16), _prompts()) == expected


def test_prefix_caching_keeps_hfs_tokens(saved):
    """Prompts sharing a 32-token prefix (four times the window), run after the first has cached it."""
    hf_model, model_dir, _ = saved
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 512, (32,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 3)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(model_dir)
    assert _greedy(engine, prompts[:1]) + _greedy(engine, prompts[1:]) == want
    assert engine.scheduler.stats().prefix_cache_hits >= 32


def test_preemption_keeps_hfs_tokens(saved):
    """Too few blocks for every request at once (16-token steps): requests are preempted and recomputed, the
    KV-shared layers reading their sources' recomputed blocks, and the tokens stay HF's."""
    hf_model, model_dir, _ = saved
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (45, 30, 52, 38)]
    want = [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in prompts]
    engine = _engine(model_dir, num_kv_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert run_engine(engine, prompts, params) == want
    assert engine.scheduler.stats().num_preemptions > 0


def _undo_proportional_rope(model) -> None:
    """The full layers rotate every frequency of their heads (the default rope) instead of a quarter."""
    full = model.rotaries["full_attention"]
    plain = RotaryEmbedding(48, full.cos_sin_cache.shape[0], 1e6)
    for layer in model.decoder_layers():
        if layer.self_attn.rotary is full:
            layer.self_attn.rotary = plain


def _read_layer_1_in_layer_4(model) -> None:
    """Layer 4 attends over layer 1's K/V (sliding too) instead of layer 3's: its cache and this step's."""
    layers, attention = model.decoder_layers(), model.attention_layers()
    layers[1].self_attn.spec = dataclasses.replace(layers[1].self_attn.spec, stores=True)
    layers[3].self_attn.spec = dataclasses.replace(layers[3].self_attn.spec, stores=False)
    for name in ("key_cache", "value_cache", "kv_group", "block_scale"):
        setattr(attention[4], name, getattr(attention[1], name))


UNDO = {
    "per-layer inputs": lambda model: setattr(model, "per_layer", 0),
    "layer scalars": lambda model: [layer.layer_scalar.fill_(1.0) for layer in model.decoder_layers()],
    "proportional rope": _undo_proportional_rope,
    "sliding window": lambda model: [setattr(a, "sliding_window", None) for a in model.attention_layers()],
    "KV sharing": _read_layer_1_in_layer_4,
}


@pytest.mark.parametrize("feature", UNDO)
def test_what_gemma4_adds_changes_the_tokens(saved, feature):
    """Each Gemma 4 feature, undone in our model, changes the tokens: the equality with HF depends on it (KV
    sharing undone: layer 4 reads the full layer's K/V instead of layer 3's)."""
    _, model_dir, expected = saved
    engine = _engine(model_dir)
    UNDO[feature](engine.runner.model)
    assert _greedy(engine, _prompts()) != expected


def test_first_step_logprobs_are_hfs(saved):
    """The final soft-capping shows in the logprobs: ours are HF's."""
    hf_model, model_dir, _ = saved
    prompts = _prompts()
    _, firsts = greedy_with_first_logprobs(model_dir, prompts, new_tokens=1, top=10, num_kv_blocks=64)
    for prompt, ours in zip(prompts, firsts, strict=True):
        with torch.no_grad():
            theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        ids = list(ours)
        torch.testing.assert_close(torch.tensor([ours[i] for i in ids]), theirs[ids], atol=LOGPROB_ATOL, rtol=0)


def test_int8_at_load_serves_its_own_dequantized_weights(saved, tmp_path):
    """`quantization="int8"` (the attention, MLP and per-layer-input linears): the greedy tokens of a float32
    checkpoint holding exactly its dequantized weights (at least 3 of the 4 prompts identical)."""
    _, model_dir, _ = saved
    engine = _engine(model_dir, quantization="int8")
    assert engine.runner.model.decoder_layers()[0].per_layer_input_gate.quantized is not None
    tokens = _greedy(engine, _prompts())
    reference = write_dequantized_checkpoint(engine.runner.model, model_dir, tmp_path / "dequantized")
    want = _greedy(_engine(reference), _prompts())
    assert identical_count(tokens, want) >= len(want) - 1, (tokens, want)


def test_tensor_parallel_matches_one_rank(saved):
    """TP=2 over gloo: each rank holds half the query heads, one of the sliding layers' two K/V heads and the
    full layers' one K/V head (replicated), half of each MLP; the per-layer inputs replicated."""
    _, model_dir, _ = saved
    runs = [
        greedy_with_first_logprobs(model_dir, _prompts(), NEW_TOKENS, tensor_parallel_size=tp, num_kv_blocks=64)
        for tp in (1, 2)
    ]
    compare_runs(runs, min_identical=len(LENGTHS) - 1)


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration (a tiny vision tower around tests/tiny_models.py's gemma4), as the hub
    publishes every Gemma 4: the config's text_config, the tensors under model.language_model.; greedy tokens
    equal HF's own model's, given text."""
    import transformers

    text = {**tiny_models.COMMON, **tiny_models.ARCHITECTURES["gemma4"][1]}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    hf_model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        language = hf_model.model.language_model
        for name, parameter in language.named_parameters():  # (as tiny_models draws its Gemma 4)
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(parameter, mean=1.0, std=0.5)
        torch.nn.init.normal_(language.embed_tokens.weight, std=0.05)
    hf_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma4ForConditionalGeneration"]
    prompts = _prompts()[1:]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(tmp_path)
    assert engine.runner.model.cfg.num_layers == 6
    assert _greedy(engine, prompts) == want


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # (a config with the MoE block over a checkpoint without experts)
        (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32), "missing weights"),
        (dict(use_bidirectional_attention="all"), "bidirectional"),
        (dict(num_kv_shared_layers=6), "leaves no layer"),
    ],
)
def test_what_is_not_supported_is_refused(saved, tmp_path, change, message):
    _, model_dir, _ = saved
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    for file in model_dir.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    with pytest.raises(ValueError, match=message):
        _engine(tmp_path)


def test_pipeline_parallel_is_refused(saved):
    _, model_dir, _ = saved
    with pytest.raises(Exception, match="pipeline parallel is not supported"):
        greedy_with_first_logprobs(model_dir, _prompts()[:1], 1, pipeline_parallel_size=2, num_kv_blocks=64)


# ---- the MoE block (Gemma 4 26B-A4B's): tests/tiny_models.py's gemma4_moe ----


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    """(HF model, its checkpoint directory, HF's greedy tokens for `_prompts()`): experts stacked in the
    checkpoint, as transformers writes them."""
    model = tiny_models.build("gemma4_moe")
    out = tmp_path_factory.mktemp("gemma4_moe")
    model.save_pretrained(out)
    expected = [hf_greedy(model, p, NEW_TOKENS, stop_at_eos=False) for p in _prompts()]
    return model, out, expected


def test_the_moe_block_matches_hf(saved_moe):
    """Whole prompts and 16-token chunks; the experts ran in the fused op with GeGLU (the C kernel, on the
    experts packed into panels)."""
    _, model_dir, expected = saved_moe
    engine = _engine(model_dir)
    moe = engine.runner.model.decoder_layers()[0].moe
    assert moe is not None and moe.packed13 is not None  # (float32 panels: kernels/cpu/moe.c)
    assert _greedy(engine, _prompts()) == expected
    assert _greedy(_engine(model_dir, max_num_batched_tokens=16), _prompts()) == expected


@pytest.mark.parametrize("undo", ["expert scales", "router scale"])
def test_the_routers_scales_change_the_tokens(saved_moe, undo):
    _, model_dir, expected = saved_moe
    engine = _engine(model_dir)
    for layer in engine.runner.model.decoder_layers():
        (layer.moe.router.per_expert_scale if undo == "expert scales" else layer.moe.router.scale).fill_(1.0)
    assert _greedy(engine, _prompts()) != expected


def test_the_moe_block_at_int4_serves_its_own_dequantized_weights(saved_moe, tmp_path):
    """`quantization="int4"`: the experts quantized as each arrives from the stacked tensors; the tokens of a
    float32 checkpoint holding its dequantized weights (at least 3 of the 4 prompts identical)."""
    from safetensors.torch import load_file, save_file

    _, model_dir, _ = saved_moe
    engine = _engine(model_dir, quantization="int4")
    moe = engine.runner.model.decoder_layers()[0].moe
    assert moe.packed13 is not None and moe.packed13.bits == 4
    tokens = _greedy(engine, _prompts())
    reference = write_dequantized_checkpoint(engine.runner.model, model_dir, tmp_path / "dequantized")
    tensors = load_file(reference / "model.safetensors")  # (the helper names experts under our `moe.`)
    save_file({n.replace(".moe.experts.", ".experts."): t for n, t in tensors.items()}, reference / "model.safetensors")
    want = _greedy(_engine(reference), _prompts())
    assert identical_count(tokens, want) >= len(want) - 1, (tokens, want)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_moe_block_splits_over_two_ranks(saved_moe, expert_parallel):
    """TP=2 (each expert's intermediate rows split, cut from the stacked tensors as they load) and EP=2 (whole
    experts per rank): tokens and first-step logprobs as one rank's."""
    _, model_dir, _ = saved_moe
    runs = [
        greedy_with_first_logprobs(model_dir, _prompts(), NEW_TOKENS, num_kv_blocks=64),
        greedy_with_first_logprobs(
            model_dir,
            _prompts(),
            NEW_TOKENS,
            tensor_parallel_size=2,
            enable_expert_parallel=expert_parallel,
            num_kv_blocks=64,
        ),
    ]
    compare_runs(runs, min_identical=len(LENGTHS) - 1)
