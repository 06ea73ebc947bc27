"""Speculative decoding with n-gram proposals and with a draft model, against the same engine without it.

The draft models are the target truncated to its first layers (same vocabulary, weights that agree with
it now and then). For both methods greedy tokens are identical on SmolLM2's golden prompts and on prompts
that invite copying, and stay identical under preemption, prefix caching, chunked prefill, stop tokens,
max_tokens landing inside a proposal and a JSON-schema constraint. Sampling keeps the target's
distribution (a chi-square test on a tiny model, which fails when proposals are kept without checking).
The KV accounting survives random acceptance patterns (hypothesis), and the counters are exact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from benchmarks.spec_decode import truncated_model
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.scheduler import Scheduler
from pagoda.engine_core.speculative.config import SpeculativeConfig
from pagoda.engine_core.speculative.ngram import propose_ngram
from pagoda.engine_core.structured_params import StructuredOutputsParams
from tests.helpers import golden_prompts, run_engine
from tests.parallel_checks import tiny_model

VOCAB = 32
EVERY_STEP = {"speculative_disable_batch_size": 4096}  # speculate however many requests run
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})


def _both(model_dir, prompts, params, method=NGRAM, **engine_args):
    """(tokens without speculation, tokens with the `method` JSON, the speculating engine's counters)."""
    runs, counters = [], None
    for spec in (None, method):
        # (Every request speculates, however many run: the self-disabling has its own test.)
        engine = EngineCore(EngineConfig(model=str(model_dir), speculative_config=spec, **EVERY_STEP, **engine_args))
        runs.append(run_engine(engine, prompts, params))
        if spec is not None:
            counters = engine.stats().spec_decode
        engine.close()
    return runs[0], runs[1], counters


def copying_prompts(tokenizer) -> list[list[int]]:
    texts = [
        "Repeat exactly: alpha, beta, gamma, delta, epsilon, zeta, eta, theta. Again: alpha, beta, gamma,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,",
    ]
    return [tokenizer.encode(text) for text in texts]


def test_ngram_proposals_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 2, 5, 3) == [4, 5, 7]  # "1 2 3" last seen before 4 5 7
    assert propose_ngram(np.array([1, 2, 3, 4]), 2, 5, 3) == []
    assert propose_ngram(np.array([8, 8, 8, 8]), 2, 5, 4) == [8]  # (the continuation ends at the end)


def test_a_bad_draft_model_is_refused_at_start(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        SpeculativeConfig.parse('{"method": "draft_model"}')
    with pytest.raises(ValueError, match='"model" is for method "draft_model"'):
        SpeculativeConfig.parse('{"method": "ngram", "model": "x"}')
    with pytest.raises(ValueError, match="draft model '/no/such/dir' does not exist"):
        EngineConfig(model=str(tiny_llama), speculative_config=draft_spec("/no/such/dir"))
    with pytest.raises(ValueError, match="do not combine"):
        EngineConfig(speculative_config=draft_spec(tiny_llama), pipeline_parallel_size=2)
    other = tiny_model(tmp_path, "other", "llama", dict(vocab_size=VOCAB + 8, eos_token_id=2))
    with pytest.raises(ValueError, match="does not share the target's vocabulary: vocab size 40 \\(target: 32\\)"):
        EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, speculative_config=draft_spec(other)))
    other_eos = tiny_model(tmp_path, "eos", "llama", dict(vocab_size=VOCAB, eos_token_id=3))
    with pytest.raises(ValueError, match="EOS ids \\[3\\] \\(target: \\[2\\]\\)"):
        EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, speculative_config=draft_spec(other_eos)))


def test_a_bad_speculative_config_is_named():
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        SpeculativeConfig.parse('{"method": "eagle"}')
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse('{"method": "ngram", "k": 3}')
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="do not combine"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)


def draft_spec(draft_dir, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def smol_draft(default_model_dir, tmp_path_factory):
    """SmolLM2's first 10 of 30 layers: a weak draft (it agrees with the whole model on ~5 % of tokens)."""
    return truncated_model(default_model_dir, tmp_path_factory.mktemp("draft") / "smol10", 10)


@pytest.fixture(params=["ngram", "draft_model", "draft_gguf"])
def smol_spec(request, smol_draft):
    """n-gram; a weak draft (SmolLM2 truncated); a strong one: SmolLM2's own Q4_1 GGUF file, whose exact
    dequantization the default fp32 model is (nearly every proposal holds; a GGUF draft's tokenizer passes)."""
    if request.param == "draft_gguf":
        return draft_spec(ensure_default_gguf(), 4)
    return NGRAM if request.param == "ngram" else draft_spec(smol_draft, 3)


@pytest.mark.slow
def test_greedy_equals_plain_decoding_on_the_golden_and_copying_prompts(default_model_dir, tokenizer, smol_spec):
    prompts = golden_prompts(tokenizer) + copying_prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain, speculated, counters = _both(default_model_dir, prompts, params, smol_spec, num_kv_blocks=512)
    assert speculated == plain
    kept, proposed = counters.num_accepted_tokens, counters.num_draft_tokens
    if smol_spec == NGRAM:
        assert 40 < kept < proposed  # the copying prompts let proposals hold, and some fail
    elif ".gguf" in smol_spec:
        assert kept > 0.9 * proposed  # the target's own weights (its fp32 checkpoint is their dequantization)
    else:
        assert 0 < kept < proposed


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 32-token vocabulary: random weights then fall into repeating loops soon, where proposals hold."""
    return tiny_model(tmp_path_factory.mktemp("spec"), "llama", "llama3", dict(vocab_size=VOCAB, eos_token_id=2))


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama, tmp_path_factory):
    """The tiny model's first 2 of 3 layers."""
    return truncated_model(tiny_llama, tmp_path_factory.mktemp("draft") / "tiny2", 2)


@pytest.fixture(params=["ngram", "draft_model"])
def tiny_spec(request, tiny_draft):
    return NGRAM if request.param == "ngram" else draft_spec(tiny_draft)


def _repetitive_prompts(seed: int, count: int, prefix_len: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (prefix_len,), generator=gen).tolist()
    prompts = []
    for _ in range(count):
        motif = torch.randint(3, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(prefix + motif * 5)
    return prompts


def test_greedy_equal_under_preemption_prefix_caching_and_chunked_prefill(tiny_llama, tiny_spec):
    """A KV pool too small for all at once (preemption), a shared 40-token prefix (cache hits), 24-token
    chunks; random-weight models repeat themselves, so proposals hold often."""
    prompts = _repetitive_prompts(3, 6, prefix_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine_args = dict(num_kv_blocks=20, max_num_batched_tokens=24)
    runs, stats = [], []
    for spec in (None, tiny_spec):
        engine = EngineCore(EngineConfig(model=str(tiny_llama), speculative_config=spec, **EVERY_STEP, **engine_args))
        runs.append(run_engine(engine, prompts, params))
        stats.append((engine.num_preemptions, engine.kv_manager.prefix_cache_hits, engine.stats().spec_decode))
    assert runs[1] == runs[0]
    preemptions, hits, counters = stats[1]
    assert preemptions > 0 and hits > 0 and counters.num_accepted_tokens > 0, stats


def test_a_draft_identical_to_the_target_has_every_greedy_proposal_kept(tiny_llama, tmp_path):
    """The target as its own draft, under preemption, prefix-cache hits and chunked prefill: every proposal
    holds, which it can only if the draft's K/V is right wherever the target's is (written in the same
    steps, in the same blocks, cached prefixes and recomputed ones included)."""
    twin = truncated_model(tiny_llama, tmp_path / "twin", 3)  # (all 3 layers)
    spec = draft_spec(twin)
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_llama), num_kv_blocks=14, max_num_batched_tokens=24, speculative_config=spec, **EVERY_STEP
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    run_engine(engine, _repetitive_prompts(3, 6, prefix_len=40), params)
    counters = engine.stats().spec_decode
    assert engine.num_preemptions > 0 and engine.kv_manager.prefix_cache_hits > 0
    assert 0 < counters.num_accepted_tokens == counters.num_draft_tokens, counters


def test_seeded_sampling_with_a_draft_is_reproducible_with_one_logprob_per_token(tiny_llama, tiny_draft):
    """Proposals drawn from the draft, uniforms and replacements all come from the request's generator:
    the same seeds give the same tokens, run alone or beside others; each token gets its logprobs."""
    prompts = _repetitive_prompts(6, 4)
    params = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=i, logprobs=2) for i in range(4)]
    runs = []
    for batch in (prompts, prompts[:1]):
        engine = EngineCore(
            EngineConfig(model=str(tiny_llama), num_kv_blocks=64, speculative_config=draft_spec(tiny_draft))
        )
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params[i])
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                assert len(delta.new_logprobs) == len(delta.new_token_ids)
                for token, logprobs in zip(delta.new_token_ids, delta.new_logprobs, strict=True):
                    assert logprobs.unpack()[0][0] == token  # (column 0: the token itself)
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        runs.append(tokens)
        assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert runs[0]["r0"] == runs[1]["r0"]


def test_tensor_parallel_target_with_an_unsharded_draft(tiny_llama, tiny_draft):
    """Under tensor parallel the draft runs whole on rank 0: greedy tokens equal those without it."""
    prompts = _repetitive_prompts(7, 3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, speculated, counters = _both(
        tiny_llama, prompts, params, draft_spec(tiny_draft), num_kv_blocks=64, tensor_parallel_size=2
    )
    assert speculated == plain and counters.num_accepted_tokens > 0


def test_max_tokens_and_stop_tokens_inside_a_proposal(tiny_llama, tiny_spec):
    """Exactly max_tokens tokens, and nothing after a stop token, whichever proposal they land in."""
    prompts = _repetitive_prompts(4, 6)
    plain_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _, _ = _both(tiny_llama, prompts, plain_params, tiny_spec, num_kv_blocks=64)
    for max_tokens in (2, 3, 5, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _, speculated, _ = _both(tiny_llama, prompts, params, tiny_spec, num_kv_blocks=64)
        assert speculated == [tokens[:max_tokens] for tokens in plain]
    stop = plain[0][9]  # a token the first request generates (and may generate earlier too)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    no_spec, speculated, _ = _both(tiny_llama, prompts, params, tiny_spec, num_kv_blocks=64)
    assert speculated == no_spec and speculated[0][-1] == stop and len(speculated[0]) <= 10


def test_json_schema_constrained_greedy_is_unchanged(default_model_dir, tokenizer, smol_spec):
    """The grammar masks every verified row as if the proposals before it were generated; a proposal it
    refuses is cut before verification."""
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 8}
        },
        "required": ["items"],
    }
    prompt = tokenizer.encode('List colours as JSON: {"items": ["red", "green", "blue", "red", "green", "blue", "red"')
    params = SamplingParams(
        temperature=0.0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=json.dumps(schema))
    )
    plain, speculated, counters = _both(default_model_dir, [prompt], params, smol_spec, num_kv_blocks=128)
    assert speculated == plain
    json.loads(tokenizer.decode(speculated[0], skip_special_tokens=True))  # valid JSON, ended by the grammar
    assert counters.num_draft_tokens > 0


def test_counters_are_exact(tiny_llama, tiny_spec):
    """Each verification: accepted = tokens the step gave the request - 1; drafts and draft tokens as
    scheduled."""
    engine = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, speculative_config=tiny_spec))
    for i, prompt in enumerate(_repetitive_prompts(5, 3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    drafts = draft_tokens = accepted = 0
    per_position = [0] * 4
    scheduled: dict[str, list[int]] = {}
    schedule = engine.scheduler.schedule

    def schedule_and_note(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.clear()
        scheduled.update(out.spec_token_ids)
        return out

    engine.scheduler.schedule = schedule_and_note  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            proposed = scheduled.get(delta.request_id)
            if proposed:
                kept = len(delta.new_token_ids) - 1
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(proposed), accepted + kept
                for position in range(kept):
                    per_position[position] += 1
    counters = engine.stats().spec_decode
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        drafts,
        draft_tokens,
        accepted,
    )
    assert counters.accepted_per_position == per_position and accepted > 0


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(tmp_path):
    """A tiny model with a 24-token vocabulary at temperature 1, 3,000 seeded requests of 4 tokens, with and
    without speculation; the speculating engine's proposer is scripted to propose tokens 8 then 5 at every
    step, so every step verifies. Each of the 2nd, 3rd and 4th tokens' distributions must be the same (a
    chi-square test of homogeneity at the 0.1 % level each); keeping proposals unchecked fails it."""
    model_dir = tiny_model(tmp_path, "tiny", "llama", dict(vocab_size=24, bos_token_id=1, eos_token_id=2))
    prompt = [5, 6, 7, 8] * 4 + [5, 6, 7]
    samples = []
    for spec in (None, NGRAM):
        config = EngineConfig(
            model=str(model_dir), num_kv_blocks=1024, max_num_seqs=256, speculative_config=spec, **EVERY_STEP
        )
        engine = EngineCore(config)
        if engine.proposer is not None:
            engine.proposer.propose = _propose_8_then_5  # type: ignore[method-assign]
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i) for i in range(3000)]
        samples.append(np.array(run_engine(engine, [prompt] * 3000, params)))
        if spec is not None:
            assert engine.stats().spec_decode.num_draft_tokens > 3000  # every step verified proposals
    _assert_same_distributions(samples, vocab_size=24)


def _assert_same_distributions(samples: list[np.ndarray], vocab_size: int) -> None:
    """Each of the 2nd, 3rd and 4th tokens' counts in the two runs' [requests, 4] samples pass a chi-square
    test of homogeneity at the 0.1 % level (tokens seen under 10 times pooled)."""
    for position in (1, 2, 3):
        table = np.array([np.bincount(sample[:, position], minlength=vocab_size) for sample in samples])
        table = table[:, table.sum(axis=0) > 0]
        common, rare = table[:, table.sum(axis=0) >= 10], table[:, table.sum(axis=0) < 10].sum(axis=1)
        _, p_value, _, _ = chi2_contingency(np.column_stack([common, rare]) if rare.any() else common)
        assert p_value > 0.001, (position, p_value, table)


def test_draft_sampling_keeps_the_target_distribution(tmp_path):
    """The same test for a draft model that samples (rejection sampling with its q): a 24-token target and
    a draft of other random weights (wider, 1 layer), 3 proposals a step, 3,000 seeded requests at
    temperature 1 with top-k 12; both acceptance and rejection happen. Keeping every proposal, or drawing
    a rejected one's replacement from p instead of (p - q)+, fails it."""
    vocab = dict(vocab_size=24, bos_token_id=1, eos_token_id=2)
    model_dir = tiny_model(tmp_path, "tiny", "llama", vocab)
    draft_dir = tiny_model(tmp_path, "draft", "llama", dict(vocab, hidden_size=256, num_hidden_layers=1))
    prompt = [5, 6, 7, 8] * 4 + [5, 6, 7]
    params = [SamplingParams(temperature=1.0, top_k=12, max_tokens=4, ignore_eos=True, seed=i) for i in range(3000)]
    samples = []
    for spec in (None, draft_spec(draft_dir, 3)):
        config = EngineConfig(
            model=str(model_dir), num_kv_blocks=2048, max_num_seqs=256, speculative_config=spec, **EVERY_STEP
        )
        engine = EngineCore(config)
        samples.append(np.array(run_engine(engine, [prompt] * 3000, params)))
        counters = engine.stats().spec_decode
    _assert_same_distributions(samples, vocab_size=24)
    assert counters.num_drafts >= 3000 and 0 < counters.num_accepted_tokens < counters.num_draft_tokens


def _propose_8_then_5(running: list[Request]) -> None:
    for request in running:
        decoding = request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1
        room = request.params.max_tokens - request.num_output_tokens - 1
        request.spec_token_ids = [8, 5][: max(room, 0)] if decoding else []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(0, 4), min_size=12, max_size=12)), min_size=1, max_size=5
    ),
    st.randoms(use_true_random=False),
)
def test_kv_accounting_under_random_acceptance(requests, rng):
    """The real scheduler and block pool (prefix caching on), requests proposing 0-4 tokens each step and
    keeping a random number of them: no block is held twice or leaked, a request never holds blocks past
    its tokens after a step, and every published block holds only the request's own tokens."""
    kv = KVCacheManager(48, 4, watermark=0.0, enable_caching=True)
    scheduler = Scheduler(kv, 24, 8, 200)
    for i, (prompt_len, _) in enumerate(requests):
        scheduler.add_request(
            Request(f"r{i}", [7 + (i + j) % 3 for j in range(prompt_len)], SamplingParams(max_tokens=12))
        )
    plans = {f"r{i}": list(plan) for i, (_, plan) in enumerate(requests)}
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        for request in scheduler.running:
            if request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = [9] * (plans[request.request_id].pop() if plans[request.request_id] else 0)
            else:
                request.spec_token_ids = []
        out = scheduler.schedule()
        for request in scheduler.running:  # published now: only blocks full of the request's own tokens
            assert kv._num_cached_blocks.get(request.request_id, 0) * 4 <= request.num_tokens
        sampled = {}
        for request in out.requests:
            proposed = out.spec_token_ids.get(request.request_id, [])
            if request.num_computed_tokens - len(proposed) == request.num_tokens:
                kept = rng.randint(0, len(proposed))
                sampled[request.request_id] = proposed[:kept] + [8]
        scheduler.update_from_output(out, sampled)
        kv.pool.check_integrity()
        for request in scheduler.running:  # rejected proposals' blocks are back in the pool
            assert len(request.block_ids[0]) <= -(-request.num_tokens // 4)
    for request in list(scheduler.requests.values()):
        scheduler.abort(request.request_id)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


@pytest.fixture(scope="module")
def tiny_drafting_engine(tiny_llama, tiny_draft):
    """A tiny target with its 2-layer draft, 8-token blocks, a pool of 12 (preemption is common)."""
    config = EngineConfig(
        model=str(tiny_llama), block_size=8, num_kv_blocks=12, speculative_config=draft_spec(tiny_draft), **EVERY_STEP
    )
    return EngineCore(config)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from([0.0, 1.0]), st.integers(0, 2**16)),
        min_size=1,
        max_size=5,
    )
)
def test_kv_accounting_with_a_draft_model(tiny_drafting_engine, requests):
    """The draft proposer takes slots for its passes and gives them back; with random requests (greedy and
    seeded sampling, so acceptance varies) the pool stays whole after every step, no running request
    holds blocks past its tokens, and an idle engine holds none."""
    engine = tiny_drafting_engine
    for i, (prompt_len, max_tokens, temperature, seed) in enumerate(requests):
        prompt = [3 + (seed + j) % (VOCAB - 3) for j in range(prompt_len)]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        engine.add_request(f"h{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        for request in engine.scheduler.running:
            assert len(request.block_ids[0]) <= -(-request.num_tokens // 8)
    engine.check_integrity()  # (idle: every block back in the pool)


def test_speculation_stands_down_for_a_busy_step_and_for_requests_whose_proposals_fail():
    from pagoda.engine_core.speculative.proposer import NgramProposer as Proposer

    def decoding(rid: str) -> Request:
        request = Request(rid, [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=100))
        request.append_token(7)
        request.num_computed_tokens = request.num_tokens - 1
        return request

    proposer = Proposer(SpeculativeConfig(disable_batch_size=2), max_model_len=1000)
    few, many = [decoding("a"), decoding("b")], [decoding(f"r{i}") for i in range(3)]
    proposer.propose(few)
    assert [r.spec_token_ids for r in few] == [[5, 6, 7]] * 2  # (the latest occurrence: its continuation ends)
    proposer.propose(many)
    assert [r.spec_token_ids for r in many] == [[]] * 3  # more running than disable_batch_size
    unlucky = decoding("u")
    unlucky.spec_proposed, unlucky.spec_accepted = 40, 3  # under 10 % of 32 or more
    proposer.propose([unlucky])
    assert unlucky.spec_token_ids == []
    unlucky.all_token_ids += [5] * 15  # 16 output tokens: tried again
    unlucky.num_computed_tokens = unlucky.num_tokens - 1
    proposer.propose([unlucky])
    assert unlucky.spec_token_ids != []
    limited = decoding("m")
    limited.params = SamplingParams(max_tokens=3)  # 1 generated: 1 more proposal, the target gives the last
    proposer.propose([limited])
    assert limited.spec_token_ids == [5]
