"""Prompt logprobs (vLLM's `prompt_logprobs`) through the offline API on the real SmolLM2 in float32: every
prompt token's logprob, rank and top N equal HF transformers' log-softmax of the same prompt, whether the
prompt is prefilled in one step or in chunks, recomputed after preemption, or partly in the prefix cache."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pagoda.engine_core import protocol
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.prompt_logprobs import compute_prompt_logprobs
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.validation import ParamError
from tests.helpers import assert_prompt_logprobs_match, hf_prompt_logprobs

TEXTS = [
    "The river town woke slowly. Fishermen checked their nets by lantern light while the bakery on the "
    "corner pulled its first loaves from the oven, and the smell of bread drifted over the water. By noon "
    "the market was full, and the ferry had crossed twice.",
    "In computing, a cache is a small, fast store that keeps copies of data likely to be needed again. "
    "Caches trade memory for time: a hit avoids a slow trip to main memory or disk, and a miss costs one.",
]


def _shown(prompt_logprobs):
    """RequestOutput.prompt_logprobs as (logprob, rank) per entry, for assert_prompt_logprobs_match."""
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in prompt_logprobs]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def references(hf_model, prompts):
    return [hf_prompt_logprobs(hf_model, p) for p in prompts]


def test_each_prompt_token_matches_hf_with_its_rank_and_the_top_n(default_model_dir, prompts, references):
    llm = LLM(str(default_model_dir), dtype="float32")
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=n) for n in (5, 0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, reference, num_top in zip(outs, prompts, references, (5, 0), strict=True):
        assert_prompt_logprobs_match(_shown(out.prompt_logprobs), prompt, reference, num_top)
        assert out.prompt_logprobs[1][prompt[1]].decoded_token == llm.tokenizer.decode([prompt[1]])
    plain, single = llm.generate(
        [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[0][:1]}],
        [SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=2, prompt_logprobs=3)],
        use_tqdm=False,
    )
    assert plain.prompt_logprobs is None and single.prompt_logprobs == [None]  # a lone token has no context
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids  # asking for them changes no output


def test_chunked_prefill_next_to_other_requests(default_model_dir, prompts, references):
    # 24-token steps: each prompt (~50 tokens) takes several, mixed with each other and a plain request.
    llm = LLM(str(default_model_dir), dtype="float32", max_num_batched_tokens=24, max_joint_prefill_tokens=24)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4)
    plain = SamplingParams(max_tokens=3, temperature=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in [*prompts, prompts[0]]], [params, params, plain], use_tqdm=False
    )
    for out, prompt, reference in zip(outs, prompts, references, strict=False):
        assert_prompt_logprobs_match(_shown(out.prompt_logprobs), prompt, reference, 4)
    assert outs[2].prompt_logprobs is None


def test_prefix_cache_hits_are_not_taken_but_its_blocks_are_published(default_model_dir, prompts, references):
    llm = LLM(str(default_model_dir), dtype="float32")
    kv = llm.engine.kv_manager
    prompt = {"prompt_token_ids": prompts[0]}
    plain = SamplingParams(max_tokens=1, temperature=0)
    asking = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens == 0  # now cached
    queries = kv.prefix_cache_queries
    out = llm.generate(prompt, asking, use_tqdm=False)[0]
    # The cached prefix has no hidden states: the request computed its whole prompt, and no lookup counted.
    assert out.num_cached_tokens == 0 and kv.prefix_cache_queries == queries
    assert_prompt_logprobs_match(_shown(out.prompt_logprobs), prompts[0], references[0], 2)
    llm.reset_prefix_cache()
    llm.generate(prompt, asking, use_tqdm=False)
    block = llm.engine.config.block_size
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens == len(prompts[0]) // block * block


def test_a_request_owing_them_does_not_wait_for_a_prefill_it_would_not_share(default_model_dir, prompts):
    engine = LLM(str(default_model_dir), dtype="float32").engine
    engine.add_request("plain", prompts[0], SamplingParams(max_tokens=1))
    engine.add_request("asking", prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1))
    # The plain request would wait for the first one's blocks; this one takes none, so it runs at once.
    assert sorted(delta.request_id for delta in engine.step()) == ["asking", "plain"]


def test_n_samples_compute_them_once_and_share_the_prompt(default_model_dir, prompts, references):
    llm = LLM(str(default_model_dir), dtype="float32")
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_prompt_logprobs_match(_shown(out.prompt_logprobs), prompts[1], references[1], 3)
    # Samples 1 and 2 owe no prompt logprobs: they waited for sample 0's blocks and took them.
    block = llm.engine.config.block_size
    assert llm.engine.kv_manager.prefix_cache_hits == 2 * (len(prompts[1]) // block * block)
    assert params.for_sample(0).prompt_logprobs == 3 and params.for_sample(1).prompt_logprobs is None


def test_recomputed_after_preemption_mid_prefill(default_model_dir, hf_model, prompts):
    # 9 usable blocks of 16 tokens and 8-token steps: the short request decodes while the long one
    # prefills 7 tokens a step, until the short one needs a block and the long one (the newest) is
    # preempted with most of its prompt logprobs gathered; its recompute must neither lose nor repeat any.
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=10, max_num_batched_tokens=8)
    short, long = prompts[1][:20], prompts[0] + prompts[1]
    params = [
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=2),
    ]
    outs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for out, prompt in zip(outs, (short, long), strict=True):
        assert_prompt_logprobs_match(_shown(out.prompt_logprobs), prompt, hf_prompt_logprobs(hf_model, prompt), 2)


@torch.inference_mode()
def test_logits_are_made_a_slice_of_rows_at_a_time(default_model_dir):
    """A long chunk's rows in slices of max_rows give what they give all at once, and the LM head never
    sees more than max_rows rows."""
    llm = LLM(str(default_model_dir), dtype="float32")
    model = llm.engine.runner.model
    hidden = torch.randn(50, llm.engine.model_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, llm.engine.model_cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    seen = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: seen.append(len(h)) or compute_logits(h)  # counts, then the real head
    try:
        ids, logprobs, ranks = compute_prompt_logprobs(model, hidden, targets, 3, max_rows=7)
    finally:
        del model.compute_logits
    assert seen == [7] * 7 + [1]
    whole = compute_prompt_logprobs(model, hidden, targets, 3, max_rows=50)
    assert np.array_equal(ids, whole[0]) and np.array_equal(ranks, whole[2])
    assert np.allclose(logprobs, whole[1], atol=1e-5)
    assert (ids[:, 0] == targets.numpy()).all() and (ranks >= 1).all()


def test_bounds_and_wire_form():
    for bad in (-1, 21):
        with pytest.raises(ParamError) as caught:
            SamplingParams(prompt_logprobs=bad)
        assert caught.value.param == "prompt_logprobs"
    ids = np.array([[5, 7, 5], [9, 9, 4]])
    # Token 5 ties with a third token at -0.5: its own rank (3, ties count against it) differs from its
    # place among the top 2.
    packed = protocol.PromptLogprobs.pack(3, ids, np.array([[-0.5, -0.4, -0.5], [-0.1, -0.1, -2.0]]), [3, 1])
    again = msgspec.msgpack.decode(protocol.encoder.encode(packed), type=protocol.PromptLogprobs)
    shown = again.by_position(lambda token_id, logprob, rank: (round(logprob, 3), rank))
    # The prompt token first with its own rank, then the top 2; one listed among those is not repeated.
    assert shown == [None, {5: (-0.5, 3), 7: (-0.4, 1)}, {9: (-0.1, 1), 4: (-2.0, 2)}]
    assert list(shown[1]) == [5, 7]
