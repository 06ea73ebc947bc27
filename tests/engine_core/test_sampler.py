"""The sampler on hand-made logits (exact expectations) and on the real model (seeds, top_k=1)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagoda.engine_core.request import Request
from pagoda.engine_core.sampler import SamplingBatch, apply_penalties
from pagoda.engine_core.sampler import sample as sample_batch
from pagoda.engine_core.sampling_params import SamplingParams

VOCAB = 8


def req(prompt, outputs=(), **params):
    r = Request("r", list(prompt), SamplingParams(**params), eos_token_ids=frozenset({0}))
    for t in outputs:
        r.append_token(t)
    return r


def sample(logits_rows, requests):
    logits = torch.tensor(logits_rows, dtype=torch.float32)
    return sample_batch(logits, SamplingBatch.from_requests(requests, VOCAB))


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 0.0]])
    # prompt has token 1, outputs have token 2 twice and token 3 once.
    r = req([1], [2, 2, 3], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [r])[0]
    expected = logits[0].clone()
    expected[1] = -2.0 * 2.0  # seen in prompt, negative -> multiplied
    expected[2] = 1.0 / 2.0 - 0.5 - 2 * 0.25  # positive -> divided, then presence + 2x frequency
    expected[3] = -1.0 * 2.0 - 0.5 - 0.25
    assert torch.allclose(out, expected)


def test_penalties_only_touch_their_own_rows():
    logits = torch.tensor([[1.0] * VOCAB, [1.0] * VOCAB])
    plain, penalized = req([1]), req([1], [2], frequency_penalty=1.0)
    out = apply_penalties(logits.clone(), [plain, penalized])
    assert torch.equal(out[0], logits[0]) and out[1, 2] == 0.0


def test_greedy_and_min_tokens():
    rows = [[0.0, 5.0, 1.0, 0, 0, 0, 0, 0], [9.0, 1.0, 0, 0, 0, 0, 0, 0], [9.0, 1.0, 0, 0, 0, 0, 0, 0]]
    out = sample(
        rows,
        [
            req([1], temperature=0),
            req([1], temperature=0, max_tokens=4),
            req([1], temperature=0, min_tokens=2, max_tokens=4),
        ],
    )
    assert out.token_ids == [1, 0, 1]  # EOS (0) is masked for the min_tokens request only


def test_logit_bias_moves_only_its_rows_tokens_and_not_logprobs():
    logits = [[0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2
    biased = req([1], temperature=0.0, logit_bias={4: 5.0, 2: -100.0}, logprobs=1)
    plain = req([1], temperature=0.0)
    out = sample(logits, [biased, plain])
    assert out.token_ids == [4, 2]
    assert out.logprobs[0].unpack()[0] == [4, 2]  # sampled 4; the top logprob is the model's own, 2
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


def test_top_k_top_p_min_p_restrict_the_support():
    torch.manual_seed(0)
    row = [math.log(p) for p in (0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005)]
    cases = [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.75), {0, 1}),
        (dict(top_p=0.85), {0, 1, 2}),
        (dict(min_p=0.15), {0, 1, 2}),
        (dict(top_k=3, top_p=0.7), {0, 1}),
    ]
    for params, allowed in cases:
        seen = set()
        for _ in range(300):
            seen.update(sample([row], [req([1], temperature=1.0, **params)]).token_ids)
        assert seen == allowed, params


def test_temperature_sampling_follows_the_distribution():
    torch.manual_seed(0)
    row = [math.log(0.7), math.log(0.3)] + [-math.inf] * 6
    draws = [sample([row] * 50, [req([1], temperature=1.0) for _ in range(50)]).token_ids for _ in range(40)]
    share = sum(t == 0 for d in draws for t in d) / 2000
    assert 0.65 < share < 0.75


def test_logprobs_are_of_the_raw_distribution():
    row = [1.0, 2.0, 3.0, 0.0, 0, 0, 0, 0]
    out = sample([row], [req([1], temperature=0, logprobs=2, min_tokens=1, max_tokens=3)])
    ref = torch.log_softmax(torch.tensor(row), -1)
    (token, *top_ids), (sampled_lp, *top_lps) = out.logprobs[0].unpack()
    assert out.token_ids == [token] == [2] and sampled_lp == pytest.approx(ref[2].item())
    assert top_ids == [2, 1] and top_lps[1] == pytest.approx(ref[1].item())


# ---- rows that have no distribution ----------------------------------------------------------------

NAN, INF = math.nan, math.inf
BAD_ROWS = {
    "a NaN": [0.0, NAN, 1.0, 0, 0, 0, 0, 0],
    "+inf": [0.0, INF, 1.0, 0, 0, 0, 0, 0],
    "every token masked": [-INF] * VOCAB,
    "all NaN": [NAN] * VOCAB,
}


@pytest.mark.parametrize("bad", list(BAD_ROWS))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_row_of_non_finite_logits_fails_alone(bad, temperature, logprobs):
    good = [0.0, 0.0, 3.0, 0, 0, 0, 0, 0]
    requests = [req([1], temperature=0.0), req([1], temperature=temperature, logprobs=logprobs), req([1], top_k=1)]
    out = sample([good, BAD_ROWS[bad], good], requests)
    assert out.failed_rows == [1]
    assert out.token_ids[0] == out.token_ids[2] == 2  # the other rows are untouched
    assert all(0 <= t < VOCAB for t in out.token_ids)  # never a token past the vocabulary


def test_finite_rows_fail_nothing():
    row = [0.0, 50.0, -1e30, 0, 0, 0, 0, -INF]  # large and masked values are fine
    out = sample([row, row], [req([1], temperature=0.0), req([1], temperature=1e-5, top_p=1e-6, min_p=1.0)])
    assert out.failed_rows == [] and out.token_ids == [1, 1]


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_best_token():
    row = [0.0, 2.0, 1.0, 0, 0, 0, 0, 0]
    out = sample([row], [req([1], temperature=1.0, top_p=1e-300)])
    assert out.failed_rows == [] and out.token_ids == [1]


def test_distributions_of_a_bad_row_are_nan_greedy_or_not():
    from pagoda.engine_core.sampler import distributions

    logits = torch.tensor([[0.0, 1.0, 2.0, 0, 0, 0, 0, 0], BAD_ROWS["a NaN"], BAD_ROWS["a NaN"]])
    requests = [req([1], temperature=0.0), req([1], temperature=0.0), req([1], temperature=1.0)]
    p = distributions(logits, SamplingBatch.from_requests(requests, VOCAB))
    assert torch.isfinite(p).all(dim=-1).tolist() == [True, False, False]


# ---- the parameters' ranges ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-40, 1e-50, 5e-324, 0.0, -0.0, 9.99e-6])
def test_temperatures_below_the_threshold_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0.0 and math.copysign(1, params.temperature) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1e-45),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", 1e300),
        ("repetition_penalty", 1e-45),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", math.nan),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("top_p", 1.0000001),
        ("min_p", math.nan),
        ("min_p", -5e-324),
        ("presence_penalty", math.inf),
        ("frequency_penalty", -math.nan),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", {1: math.inf}),
    ],
)
def test_values_outside_the_finite_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert getattr(error.value, "param", None) == field


# ---- on the real model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from pagoda.engine_core.llm import LLM

    return LLM(str(default_model_dir))


PROMPTS = [
    "The best way to learn a language is",
    "Once upon a time, in a small village,",
    "Here is a recipe for pancakes:",
    "The three laws of motion are",
]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate(PROMPTS[0], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    mixed = llm.generate(PROMPTS[1:] + PROMPTS[:1], others + [seeded], use_tqdm=False)
    assert _tokens(mixed)[-1] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert _tokens(llm.generate(PROMPTS[0], other_seed, use_tqdm=False))[0] != alone


def _numbers(outputs):
    """Each request's sampled tokens and every logprob it returned (floats, in which a row computed
    otherwise shows)."""
    numbers = []
    for output in outputs:
        completion = output.outputs[0]
        steps = zip(completion.token_ids, completion.logprobs or [], strict=True)
        numbers.append([(token, sorted((k, v.logprob) for k, v in top.items())) for token, top in steps])
    return numbers


def test_long_and_short_prompts_give_the_same_numbers_in_any_batch(default_model_dir):
    """A long prompt's rows are bulk rows (engine_core/model_runner.py BULK_PROMPT_TOKENS), which the
    linears may compute on another unit (AMX): whether a row is one depends on its request alone. So a
    shorter prompt prefilled beside a long one, a long one beside others and decodes, and a long one
    prefilled in chunks of 64 give the numbers each gives alone, to the bit. (Not a last chunk of 16
    tokens or fewer: such a step attends as decodes, which rounds otherwise, with AMX or without. No
    prefix cache: a block it holds was computed by whichever request came first, as bulk rows or not.)"""
    from pagoda.engine_core.llm import LLM
    from pagoda.engine_core.model_runner import BULK_PROMPT_TOKENS

    llm = LLM(str(default_model_dir), enable_prefix_caching=False)
    short_prompt, long_prompt = " ".join(PROMPTS * 2), " ".join(PROMPTS * 8)
    assert 16 < len(llm.tokenizer.encode(short_prompt)) < BULK_PROMPT_TOKENS
    assert len(llm.tokenizer.encode(long_prompt)) == 248
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=20, ignore_eos=True)
    short_alone = _numbers(llm.generate(short_prompt, seeded, use_tqdm=False))[0]
    long_alone = _numbers(llm.generate(long_prompt, seeded, use_tqdm=False))[0]
    together = _numbers(
        llm.generate(
            [PROMPTS[1], long_prompt, short_prompt],
            [SamplingParams(temperature=1.0, max_tokens=12, logprobs=20, ignore_eos=True), seeded, seeded],
            use_tqdm=False,
        )
    )
    assert together[2] == short_alone
    assert together[1] == long_alone
    chunked = LLM(str(default_model_dir), max_num_batched_tokens=64, enable_prefix_caching=False)  # 3 x 64 + 56
    assert _numbers(chunked.generate(long_prompt, seeded, use_tqdm=False))[0] == long_alone


def test_top_k_1_equals_greedy(llm):
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False))
    top1 = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=20), use_tqdm=False))
    assert top1 == greedy


def penalized_by_definition(
    logits: torch.Tensor,
    prompt: list[int],
    outputs: list[int],
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
) -> torch.Tensor:
    """One row of logits penalised token by token, as vLLM defines the penalties: every token seen in the
    prompt or the output has a positive logit divided by `repetition_penalty`, a negative one multiplied
    by it; then (OpenAI's presence and frequency penalties) every token of the output loses
    `presence_penalty` once and `frequency_penalty` per occurrence."""
    out = logits.clone()
    for token in set(prompt) | set(outputs):
        value = out[token].item()
        out[token] = value / repetition_penalty if value > 0 else value * repetition_penalty
    for token, count in Counter(outputs).items():
        out[token] -= presence_penalty + frequency_penalty * count
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.0},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    ],
)
def test_penalized_greedy_output_follows_the_definitions(llm, hf_model, tokenizer, penalties):
    """Each greedy token under penalties is the argmax of the model's logits penalised by the definitions
    above (the logits from HF transformers, fp32, as the golden tests compare), and the penalties did
    decide tokens: the unpenalised argmax differs at some step."""
    prompt = tokenizer.encode("one two one two one two one two")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalties)
    penalized = _tokens(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False))[0]
    assert len(penalized) == 12
    if "presence_penalty" in penalties or "frequency_penalty" in penalties:
        # some output token repeats: presence (once per token) and frequency (per occurrence) differ
        assert max(Counter(penalized).values()) > 1, tokenizer.decode(penalized)
    with torch.no_grad():  # row i: the logits the i-th output token was chosen from
        logits = hf_model(torch.tensor([prompt + penalized])).logits[0, len(prompt) - 1 : -1].float()
    decided = 0
    for i, token in enumerate(penalized):
        expected = penalized_by_definition(logits[i], prompt, penalized[:i], **penalties)
        request = Request("r", prompt, params, eos_token_ids=frozenset({2}))
        for t in penalized[:i]:
            request.append_token(t)
        torch.testing.assert_close(apply_penalties(logits[i : i + 1].clone(), [request])[0], expected)
        assert expected.argmax().item() == token, (i, tokenizer.decode([token]), tokenizer.decode([expected.argmax()]))
        decided += logits[i].argmax().item() != token
    assert decided > 0, "the penalties changed no token: this prompt cannot tell them from none"
