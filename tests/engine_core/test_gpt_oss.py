"""gpt-oss (engine_core/models/gpt_oss.py) on the tiny random checkpoint of tests/tiny_models.py: greedy tokens
equal HF's (float32, eager attention: the one with sinks) with prompts longer than its 8-token sliding window,
under chunked prefill and prefix caching; first-step logprobs close to HF's; the sinks and the window both
change the tokens (so the equality above tests them); MXFP4 experts stay 4-bit and equal HF's
dequantization; the experts, float32 and MXFP4, run in the fused MoE's C kernel; chat through the
checkpoint's template; and what is refused, with the limit named. Tensor, expert and pipeline parallel:
tests/engine_core/test_gpt_oss_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models import model_class
from pagoda.engine_core.models.gpt_oss import GptOssMLP
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.torch_ref.moe import expert_matrix
from tests import tiny_models
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine

NEW_TOKENS = 24
# Lengths: one token, inside the 8-token window, and well past it (the longest in several chunks).
LENGTHS = (1, 6, 17, 33, 70)
assert LENGTHS[:2] == (1, 6)  # (the window test's short prompts)
# First-step logprobs: ours against HF's eager float32 run. The largest measured difference is 1.7e-5; the bound
# leaves room for another CPU's summation order, and is far below the gaps greedy decoding depends on.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its checkpoint directory)."""
    model = tiny_models.build("gpt_oss")
    out = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(out)
    return model, out


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(saved):
    hf_model, _ = saved
    return [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in _prompts()]


def _engine(model_dir, **args) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **args}))


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return run_engine(engine, prompts, params)


def _experts_run_in_c(engine: EngineCore, layout: type, monkeypatch) -> None:
    """Where the C kernels build (and are on): every layer's experts are in `layout`, one the fused MoE's C
    kernel reads (float32 panels packed at load, or the MXFP4 blocks as stored), and from here on the torch
    reference raises if it runs (the C op falls back to it for what it does not compute)."""
    cpu_device = torch.device("cpu")
    if not ops.compiled("fused_moe", cpu_device):
        return
    assert ops.implementation("fused_moe", cpu_device) is cpu_moe.fused_moe
    for layer in engine.runner.model.decoder_layers():
        w13, w2 = layer.mlp.experts()
        assert isinstance(w13, layout) and isinstance(w2, layout)

    def refuse(*args, **kwargs):
        raise AssertionError("gpt-oss's experts ran the torch reference")

    monkeypatch.setattr(cpu_moe.reference, "fused_moe", refuse)


def test_the_layers_are_hfs(saved):
    """Sliding and full attention alternate as layer_types say; every layer has sinks and an MoE MLP."""
    _, model_dir = saved
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.is_moe and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.moe_intermediate_size == 64
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
    assert [a.sliding_window for a in model.attention_layers()] == [8, None, 8, None]
    assert all(a.sinks is not None and a.sinks.shape == (4,) for a in model.attention_layers())
    assert all(isinstance(layer.mlp, GptOssMLP) for layer in model.decoder_layers())


def test_without_layer_types_the_layers_alternate_as_hfs_default(saved, tmp_path):
    """A config without layer_types: HF's default (sliding in the even layers) is ours too."""
    _, model_dir = saved
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.layer_types == ()
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
    assert [a.sliding_window for a in model.attention_layers()] == [8, None, 8, None]


def test_pooling_runs_like_hf(saved):
    """`--runner pooling` (whole prompts, no KV cache: the varlen attention with sinks): the last token's
    final hidden state equals HF's."""
    from pagoda.engine_core.engine import create_engine
    from pagoda.engine_core.pooling.params import PoolingParams

    hf_model, model_dir = saved
    engine = create_engine(EngineConfig(model=str(model_dir), runner="pooling", normalize=False))
    prompts = _prompts()[1:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, pooling=PoolingParams())
    pooled = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            pooled[delta.request_id] = torch.from_numpy(delta.pooled.array()[0].copy())
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(pooled[str(i)], want, atol=1e-5, rtol=1e-4)


def test_greedy_matches_hf_chunked(saved, expected, monkeypatch):
    """Prompts past the window, the longest split into 48-token chunks; the experts in the C kernel."""
    _, model_dir = saved
    engine = _engine(model_dir, max_num_batched_tokens=48)
    _experts_run_in_c(engine, ExpertPanels, monkeypatch)
    assert _greedy(engine, _prompts()) == expected


def test_prefix_caching_keeps_hfs_tokens(saved):
    """Prompts sharing a 40-token prefix (five times the window), run after the first has cached it."""
    hf_model, model_dir = saved
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (20, 5, 13)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(model_dir, max_num_batched_tokens=32)
    assert _greedy(engine, prompts[:1]) + _greedy(engine, prompts[1:]) == want
    assert engine.scheduler.stats().prefix_cache_hits >= 2 * 32  # (two whole 16-token blocks, twice)


def test_first_step_logprobs_are_hfs(saved):
    hf_model, model_dir = saved
    prompts = _prompts()
    _, firsts = greedy_with_first_logprobs(model_dir, prompts, new_tokens=1, top=10)
    for prompt, ours in zip(prompts, firsts, strict=True):
        with torch.no_grad():
            theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        ids = list(ours)
        torch.testing.assert_close(torch.tensor([ours[i] for i in ids]), theirs[ids], atol=LOGPROB_ATOL, rtol=0)
        assert ids[0] == int(theirs.argmax())


def test_zeroed_sinks_change_the_tokens(saved, expected):
    """Zeroing the sinks in our model only changes the tokens: the equality with HF depends on them, and the
    kernels use the sinks they are given (a zero sink still adds e^0 to each denominator)."""
    _, model_dir = saved
    engine = _engine(model_dir)
    assert _greedy(engine, _prompts()) == expected
    with torch.no_grad():
        for attention in engine.runner.model.attention_layers():
            assert attention.sinks is not None
            attention.sinks.zero_()
    assert _greedy(engine, _prompts()) != expected


def test_the_sliding_layers_attend_only_inside_their_window(saved, expected):
    """Letting the sliding layers see every earlier token changes the tokens of the prompts longer than
    their 8-token window, and only those: with the window, ours are HF's."""
    _, model_dir = saved
    engine = _engine(model_dir)
    assert _greedy(engine, _prompts()) == expected
    for attention in engine.runner.model.attention_layers():
        attention.sliding_window = None
    tokens = _greedy(engine, _prompts())
    assert all(tokens[i] != expected[i] for i, n in enumerate(LENGTHS) if n > 8)
    # The 1- and 6-token prompts' first 2 tokens: every sequence within 8 tokens, the window changes nothing.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert run_engine(engine, _prompts()[:2], params) == [e[:2] for e in expected[:2]]


def test_mxfp4_experts_stay_4_bit_and_equal_hfs_dequantization(saved, tmp_path, monkeypatch):
    hf_model, model_dir = saved
    dequantized = tiny_models.save_gpt_oss_mxfp4(hf_model, model_dir, tmp_path / "mxfp4")
    engine = _engine(tmp_path / "mxfp4")
    model = engine.runner.model
    for layer, (gate_up, down) in zip(model.decoder_layers(), dequantized, strict=True):
        mlp = layer.mlp
        assert isinstance(mlp.w13, Mxfp4Experts) and isinstance(mlp.w2, Mxfp4Experts)
        # HF's [E, in, out] with gate/up interleaved in `out`; ours [E, out, in], gate rows then up rows.
        hf_w13 = gate_up.transpose(1, 2)
        assert torch.equal(mlp.w13.dequantized(), torch.cat((hf_w13[:, 0::2], hf_w13[:, 1::2]), dim=1))
        assert torch.equal(mlp.w2.dequantized(), down.transpose(1, 2))
    # No full-precision copy of any expert matrix: the only 3-D parameters are the uint8 blocks.
    stacked = [(n, p.dtype) for n, p in model.named_parameters() if p.dim() >= 3]
    assert stacked and all(dtype == torch.uint8 for _, dtype in stacked), stacked
    # HF's model run on the dequantized experts: the same greedy tokens.
    with torch.no_grad():
        for layer, (gate_up, down) in zip(hf_model.model.layers, dequantized, strict=True):
            layer.mlp.experts.gate_up_proj.copy_(gate_up)
            layer.mlp.experts.down_proj.copy_(down)
    try:
        prompts = _prompts(seed=5)[1:4]
        want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    finally:  # (the module's HF model is shared: put its float experts back)
        original = load_file(str(model_dir / "model.safetensors"))
        with torch.no_grad():
            for i, layer in enumerate(hf_model.model.layers):
                layer.mlp.experts.gate_up_proj.copy_(original[f"model.layers.{i}.mlp.experts.gate_up_proj"])
                layer.mlp.experts.down_proj.copy_(original[f"model.layers.{i}.mlp.experts.down_proj"])
    _experts_run_in_c(engine, Mxfp4Experts, monkeypatch)  # (the blocks read by the kernel, never dequantized)
    assert _greedy(engine, prompts) == want


def test_mxfp4_is_refused_with_another_quantization_or_architecture(saved, tmp_path):
    hf_model, model_dir = saved
    tiny_models.save_gpt_oss_mxfp4(hf_model, model_dir, tmp_path / "mxfp4")
    with pytest.raises(ValueError, match=r"experts are quantized with 'mxfp4'; --quantization int8 cannot"):
        _engine(tmp_path / "mxfp4", quantization="int8")
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'mxfp4', which Pagoda loads for GptOssForCausalLM only"):
        _engine(tmp_path / "mxfp4")


@pytest.mark.parametrize("flag", ["int8", "int4", "fp8"])
def test_quantizing_at_load_is_refused(saved, flag):
    _, model_dir = saved
    with pytest.raises(ValueError, match=r"mixture-of-experts model: quantized weights .* not supported for it"):
        _engine(model_dir, quantization=flag)


def test_chat_through_the_checkpoints_template(tmp_path, default_model_dir):
    """A servable tiny gpt-oss (SmolLM2's tokenizer and chat template beside it): chat renders through the
    template and generates HF's greedy tokens for the rendered prompt."""
    from transformers import AutoModelForCausalLM

    from pagoda.engine_core.llm import LLM
    from pagoda.engine_core.tokenizer import encode_chat, load_tokenizer

    tiny_models.save_servable("gpt_oss", tmp_path, default_model_dir)
    messages = [{"role": "user", "content": "What is a cache?"}]
    prompt = encode_chat(load_tokenizer(tmp_path), messages)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    want = hf_greedy(hf_model, prompt, 8, stop_at_eos=False)
    llm = LLM(str(tmp_path), num_kv_blocks=32)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == prompt and list(out[0].outputs[0].token_ids) == want


@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_dummy_weights_run_from_a_config_alone(tmp_path, experts):
    """`load_format="dummy"` (benchmarks: a model from its config.json alone; the released configs declare
    MXFP4 experts) draws every weight, MXFP4 blocks and scales included, to a finite model."""
    config_cls, extra = tiny_models.ARCHITECTURES["gpt_oss"]
    config = config_cls(**{**tiny_models.COMMON, **extra}, architectures=["GptOssForCausalLM"])
    if experts == "mxfp4":
        config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(tmp_path)
    engine = _engine(tmp_path, load_format="dummy")
    mlp = engine.runner.model.decoder_layers()[0].mlp
    stored = mlp.experts()[0]  # (float32: panels where the C kernel runs)
    w13 = torch.stack([expert_matrix(stored, e, torch.float32) for e in range(mlp.w13_bias.shape[0])])
    assert isinstance(mlp.w13, Mxfp4Experts) == (experts == "mxfp4")
    assert bool(torch.isfinite(w13).all()) and 0.05 < float(w13.std()) * 64**0.5 < 20
    tokens = run_engine(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(tokens[0]) == 8


def test_bfloat16_runs_and_its_first_tokens_agree_with_float32(saved):
    _, model_dir = saved
    prompts = _prompts()[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {dtype: run_engine(_engine(model_dir, dtype=dtype), prompts, params) for dtype in ("bfloat16", "float32")}
    assert all(len(t) == 4 for t in runs["bfloat16"])
    assert [t[0] for t in runs["bfloat16"]] == [t[0] for t in runs["float32"]]
