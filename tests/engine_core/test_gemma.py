"""Gemma 2 and Gemma 3 (engine_core/models/gemma.py) on the tiny random checkpoints of tests/tiny_models.py:
greedy tokens equal HF's (float32, eager attention) for prompts longer than their 8-token sliding window,
whole, under chunked prefill and with prefix caching; first-step logprobs close to HF's (they see the final
logit soft-capping, which greedy tokens cannot: tanh keeps the order); the attention soft-capping, the
norms' (1 + w), the sliding window and Gemma 3's two rotary tables all change the tokens (so the equality
tests them); quantized at load (int8) against a float checkpoint of its own dequantized weights, as
tests/engine_core/test_quantization.py compares its models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models import model_class
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine
from tests.parallel_checks import compare_runs
from tests.quantization_helpers import identical_count, write_dequantized_checkpoint

NEW_TOKENS = 16
LENGTHS = (1, 6, 17, 40)  # (one token, inside the 8-token window, past it)
LOGPROB_ATOL = 1e-4  # (as tests/engine_core/test_gpt_oss.py: float32, only summation order differs)
FAMILIES = tiny_models.GEMMA


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(family, HF model, its checkpoint directory, HF's greedy tokens for `_prompts()`)."""
    model = tiny_models.build(request.param)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    expected = [hf_greedy(model, p, NEW_TOKENS, stop_at_eos=False) for p in _prompts()]
    return request.param, model, out, expected


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LENGTHS]


def _engine(model_dir, **args) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **args}))


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return run_engine(engine, prompts, params)


def test_the_layers_are_hfs(saved):
    """Sliding and full layers as layer_types say, HF's attention scale and soft-capping."""
    family, _, model_dir, _ = saved
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
    windows = [a.sliding_window for a in model.attention_layers()]
    assert windows == ([8, None, 8, None] if family == "gemma2" else [8, 8, None, 8])
    assert all(a.scale == 24**-0.5 for a in model.attention_layers())
    assert [a.softcap for a in model.attention_layers()] == [3.0 if family == "gemma2" else 0.0] * 4
    if family == "gemma3":  # (two tables: the sliding layers' base 10,000, the full layers' 1e6 scaled)
        rotaries = {id(layer.self_attn.rotary) for layer in model.decoder_layers()}
        assert len(rotaries) == 2


def test_greedy_matches_hf(saved):
    _, _, model_dir, expected = saved
    assert _greedy(_engine(model_dir), _prompts()) == expected


def test_greedy_matches_hf_chunked(saved):
    """The longest prompts split into 16-token chunks (paged prefill over the cached earlier chunks)."""
    _, _, model_dir, expected = saved
    assert _greedy(_engine(model_dir, max_num_batched_tokens=16), _prompts()) == expected


def test_prefix_caching_keeps_hfs_tokens(saved):
    """Prompts sharing a 32-token prefix (four times the window), run after the first has cached it."""
    _, hf_model, model_dir, _ = saved
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 512, (32,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 3)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(model_dir)
    assert _greedy(engine, prompts[:1]) + _greedy(engine, prompts[1:]) == want
    assert engine.scheduler.stats().prefix_cache_hits >= 32


def test_what_gemma_adds_changes_the_tokens(saved):
    """Each Gemma feature, undone in our model, changes the tokens: the equality with HF depends on it."""
    family, _, model_dir, expected = saved
    engine = _engine(model_dir)
    model = engine.runner.model
    assert _greedy(engine, _prompts()) == expected
    undo = []
    if family == "gemma2":
        undo.append(lambda: [setattr(a, "softcap", 0.0) for a in model.attention_layers()])
    else:
        global_rotary = model.decoder_layers()[2].self_attn.rotary
        undo.append(lambda: [setattr(layer.self_attn, "rotary", global_rotary) for layer in model.decoder_layers()])
    undo.append(lambda: [setattr(a, "sliding_window", None) for a in model.attention_layers()])
    norm = model.decoder_layers()[1].post_feedforward_layernorm.weight
    undo.append(lambda: norm.sub_(1.0))  # (Llama's w instead of Gemma's 1 + w, in one norm)
    for change in undo:
        change()
        assert _greedy(engine, _prompts()) != expected
        engine = _engine(model_dir)  # (a fresh model for the next one)
        model = engine.runner.model
        norm = model.decoder_layers()[1].post_feedforward_layernorm.weight
        global_rotary = model.decoder_layers()[2].self_attn.rotary


def test_first_step_logprobs_are_hfs(saved):
    """The final soft-capping (Gemma 2's) shows in the logprobs: ours are HF's."""
    _, hf_model, model_dir, _ = saved
    prompts = _prompts()
    _, firsts = greedy_with_first_logprobs(model_dir, prompts, new_tokens=1, top=10, num_kv_blocks=64)
    for prompt, ours in zip(prompts, firsts, strict=True):
        with torch.no_grad():
            theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        ids = list(ours)
        torch.testing.assert_close(torch.tensor([ours[i] for i in ids]), theirs[ids], atol=LOGPROB_ATOL, rtol=0)


def test_int8_at_load_serves_its_own_dequantized_weights(saved, tmp_path):
    """`quantization="int8"`: the greedy tokens of a float32 checkpoint holding exactly its dequantized
    weights (only summation order differs: at least 3 of the 4 prompts identical)."""
    _, _, model_dir, _ = saved
    engine = _engine(model_dir, quantization="int8")
    assert engine.runner.quantization is not None and engine.runner.quantization.name == "int8"
    tokens = _greedy(engine, _prompts())
    reference = write_dequantized_checkpoint(engine.runner.model, model_dir, tmp_path / "dequantized")
    # (the helper writes our norm weights, which hold Gemma's 1 + w: the checkpoint's are w)
    tensors = load_file(reference / "model.safetensors")
    save_file(
        {n: t - 1.0 if n.endswith("norm.weight") else t for n, t in tensors.items()}, reference / "model.safetensors"
    )
    want = _greedy(_engine(reference), _prompts())
    assert identical_count(tokens, want) >= len(want) - 1, (tokens, want)


def test_tensor_parallel_matches_one_rank(saved):
    """TP=2 over gloo (worker processes): each rank holds half the heads and half of GeGLU's gate and up rows,
    the vocabulary split (the embedding scaled after its all-reduce, each slice of logits capped); tokens and
    first-step logprobs as one rank's (tests/parallel_checks.py)."""
    _, _, model_dir, _ = saved
    runs = [
        greedy_with_first_logprobs(model_dir, _prompts(), NEW_TOKENS, tensor_parallel_size=tp, num_kv_blocks=64)
        for tp in (1, 2)
    ]
    compare_runs(runs, min_identical=len(LENGTHS) - 1)


def test_a_vision_language_checkpoint_serves_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration (a tiny SigLIP tower around tests/tiny_models.py's gemma3): the config's
    text_config and the tensors under language_model.; greedy tokens equal HF's own model's, given text."""
    import transformers

    text = {**tiny_models.COMMON, **tiny_models.ARCHITECTURES["gemma3"][1]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(vision, patch_size=14), mm_tokens_per_image=4
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():  # (as tiny_models draws its Gemma)
            if "language_model" in name and name.endswith("norm.weight"):
                torch.nn.init.normal_(parameter, std=2.0)
        torch.nn.init.normal_(hf_model.get_input_embeddings().weight, std=0.05)
    hf_model.save_pretrained(tmp_path)
    prompts = _prompts()[1:]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(tmp_path)
    assert engine.runner.model.cfg.num_layers == 4
    assert _greedy(engine, prompts) == want


def test_decode_steps_run_layer_by_layer(saved):
    """The fused CPU decoder computes Llama's layer: Gemma's decode steps never take it, even with every
    layer's window alike (mixed windows alone would already keep the C decoder out)."""
    from tests.engine_core.fused_decode_checks import LayeredCheck

    _, _, model_dir, _ = saved
    engine = _engine(model_dir)
    for attention in engine.runner.model.attention_layers():
        attention.sliding_window = None
    with LayeredCheck(engine.runner.model) as check:
        _greedy(engine, _prompts())
    assert check.calls == 0
