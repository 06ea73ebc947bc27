"""Int8 activations in the engine (on by default where the CPU has VNNI; the suite turns them off, see
tests/conftest.py): the engine takes the integer path for every decode-sized batch, scores a text as float
activations do within a small share of its log-likelihood, and `--no-int8-activations` keeps float
activations; a mixture-of-experts model's experts take them too. The kernels' numbers are checked against
the rounded rows, and a row's independence of its batch, in tests/kernels/test_quantized_linear.py and
test_fused_moe_int8.py."""

from __future__ import annotations

import math

import pytest

from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.models.moe import MoEMLP
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import cpu
from pagoda.kernels.cpu import moe as cpu_moe
from pagoda.kernels.quantized import PackedWeight
from tests import tiny_models
from tests.helpers import PARAGRAPHS

KV = 256 * 1024**2


def _packed_weights(llm: LLM) -> list[PackedWeight]:
    """The model's quantized linears' weights."""
    return [
        module.quantized
        for module in llm.engine.runner.model.modules()
        if isinstance(getattr(module, "quantized", None), PackedWeight)
    ]


def _llm(**config) -> LLM:
    # Steps of at most 64 tokens keep every linear below the oneDNN tiles (float activations from 128 rows).
    return LLM(str(ensure_default_gguf()), kv_cache_memory=KV, max_num_batched_tokens=64, **config)


def _nll(llm: LLM, text: str) -> tuple[float, int]:
    """The text's summed negative log-likelihood (each token given the ones before it) and its token count."""
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return -sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))), len(ids) - 1


def test_the_engine_scores_a_text_with_int8_activations_as_with_float_ones(int8_activations_on):
    """SmolLM2's Q4_1 GGUF on four paragraphs: the perplexity with int8 activations is within 2 % of float
    activations' (benchmarks/perplexity.py measured +0.31 % on 4,096 tokens; wrong block scales, mins or
    lanes cost tens of percent), and every linear took the integer path."""
    text = " ".join(PARAGRAPHS[:4])
    rounded = _llm()
    if not cpu.settings.int8_activations or "quantized_linear_q8_f32" not in (cpu.load() or {}):
        pytest.skip("this CPU has no VNNI: float activations only")
    packed = _packed_weights(rounded)
    assert packed and {cpu.path(cpu.load(), rows, w) for w in packed for rows in (1, 5, 64)} == {"int8"}
    nll_int8, count = _nll(rounded, text)
    del rounded
    nll_float, count_float = _nll(_llm(int8_activations=False), text)
    assert count == count_float > 100
    change = math.exp(nll_int8 / count) / math.exp(nll_float / count) - 1
    assert abs(change) < 0.02, f"perplexity {change:+.2%} against float activations"


def test_no_int8_activations_keeps_float_activations(int8_activations_on):
    llm = _llm(int8_activations=False)
    assert not cpu.settings.int8_activations
    packed = _packed_weights(llm)
    assert packed and {cpu.path(cpu.load(), rows, packed[0]) for rows in (1, 5)} == {"fused", "batch"}


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]


def test_moe_experts_take_int8_activations(tmp_path, int8_activations_on):
    """A tiny Qwen3-MoE at `--quantization int4`: every MoE layer's experts go through int8 activations, and
    the prompt's log-probabilities move by little (the rounding's) against float activations."""
    model_dir = tmp_path / "qwen3_moe"
    tiny_models.build("qwen3_moe").save_pretrained(model_dir)
    rounded = LLM(str(model_dir), quantization="int4", kv_cache_memory=KV)
    if not cpu.settings.int8_activations or "moe_q8_workspace" not in (cpu.load() or {}):
        pytest.skip("this CPU has no VNNI: float activations only")
    layers = [layer.mlp for layer in rounded.engine.runner.model.decoder_layers() if isinstance(layer.mlp, MoEMLP)]
    assert layers and all(cpu_moe.int8_activations(cpu.load(), *mlp.experts()) for mlp in layers)
    ids = list(range(5, 70))
    with_int8 = _prompt_logprobs(rounded, ids)
    del rounded
    with_float = _prompt_logprobs(
        LLM(str(model_dir), quantization="int4", kv_cache_memory=KV, int8_activations=False), ids
    )
    changes = [abs(a - b) for a, b in zip(with_int8, with_float, strict=True)]
    # (this tiny model's large random weights make its logits sensitive: the dense linears' rounding alone
    # moves them by 0.07 on average; a wrong scale or row moves them by whole units)
    assert 0 < sum(changes) / len(changes) < 0.2, changes
