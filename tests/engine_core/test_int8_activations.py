"""Int8 activations in the engine (on by default where the CPU has VNNI; the suite turns them off, see
tests/conftest.py): the engine takes the integer path for every decode-sized batch, scores a text as float
activations do within a small share of its log-likelihood, and `--no-int8-activations` keeps float
activations. The kernel's numbers are checked exactly against the rounded rows, and a row's independence
of its batch, in tests/kernels/test_quantized_linear.py."""

from __future__ import annotations

import math

import pytest

from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import cpu
from pagoda.kernels.quantized import PackedWeight
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
