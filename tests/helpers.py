"""Test helpers: run an EngineCore to completion, and HF greedy references."""

from __future__ import annotations

import torch

from pagoda.engine_core.sampling_params import SamplingParams


def run_engine(
    engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], check_blocks: bool = True
) -> list[list[int]]:
    """Add every prompt, step until all finish; return each request's generated token ids."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
        engine.add_request(rid, prompt, p)
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        if check_blocks:
            engine.check_integrity()
    if check_blocks:
        pool = engine.kv_manager.pool
        assert pool.num_free_blocks == pool.num_usable_blocks, "KV blocks leaked"
    return [outputs[rid] for rid in ids]


def greedy_with_first_logprobs(
    model_dir, prompts: list[list[int]], new_tokens: int = 32, top: int = 20, **engine_args
) -> tuple[list[list[int]], list[dict[int, float]]]:
    """A fresh engine on `model_dir`: each prompt's greedy tokens (ignore_eos), and its first step's top
    logprobs {token: logprob} (the quantized formats' comparisons with their references)."""
    from pagoda.engine_core.config import EngineConfig
    from pagoda.engine_core.engine import EngineCore

    engine = EngineCore(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 128, **engine_args}))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=top)
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, dict[int, float]] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.new_logprobs and out.request_id not in first:
                    sampled = out.new_logprobs[0].sampled_and_top()
                    first[out.request_id] = dict(zip(sampled.top_ids, sampled.top_logprobs, strict=True))
    finally:
        engine.close()  # (tensor parallel: its workers)
    return [tokens[rid] for rid in ids], [first[rid] for rid in ids]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """HF transformers `generate`, greedy, fp32, one prompt, no repetition penalty. The model is left as it
    was (the session's `hf_model` is shared): not stopping at EOS is an argument of this call only."""
    input_ids = torch.tensor([prompt])
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "pad_token_id": None}  # these override the model's
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        repetition_penalty=1.0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


PARAGRAPHS = [
    "The river town woke slowly. Fishermen checked their nets by lantern light while the bakery on the "
    "corner pulled its first loaves from the oven, and the smell of bread drifted over the water.",
    "In computing, a cache is a small, fast store that keeps copies of data likely to be needed again. "
    "Caches trade memory for time: a hit avoids a slow trip to main memory or disk.",
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide and water "
    "and, using sunlight captured by chlorophyll, produce glucose and release oxygen.",
    "The committee met on Tuesday to review the budget. After a long debate about road repairs, the "
    "members agreed to fund the new library and postpone the stadium renovation.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic, then crushed tomatoes, "
    "a pinch of salt and fresh basil. Simmer for twenty minutes, stirring now and then.",
    "Mountains form when tectonic plates collide. Over millions of years, the crust folds and rises, "
    "while wind, rain and ice wear the peaks down into valleys and ridges.",
]


def golden_prompts(tokenizer) -> list[list[int]]:
    """The golden prompts: 10 prompts from 1 to ~1,500 tokens, as token ids."""
    texts = [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        PARAGRAPHS[0],
        " ".join(PARAGRAPHS[:3]) + " In summary,",
        "Question: Why is the sky blue?\nAnswer:",
        "\n\n".join(PARAGRAPHS * 2) + "\n\nWrite a short title for the text above:",
        "\n".join(f"{i}. {PARAGRAPHS[i % 6]}" for i in range(14)) + "\nThe main topics were",
        "\n".join(PARAGRAPHS[::-1] * 6) + "\nThe last paragraph was about",
        "List three colors: red,",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts.insert(0, tokenizer.encode("Once")[:1])  # a 1-token prompt
    return prompts


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """HF transformers' float32 log-softmax over a prompt: row i is the distribution of prompt token i + 1."""
    logits = model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)).logits
    return torch.log_softmax(logits[0, :-1].float(), dim=-1)


def assert_prompt_logprobs_match(
    ours: list[dict[int, tuple[float, int]] | None], prompt: list[int], reference: torch.Tensor, num_top: int
) -> None:
    """`ours` (vLLM's shape, each entry as (logprob, rank)) against HF's log-softmax of the same prompt:
    the prompt token's logprob within 1e-4 and its rank exact (up to tokens within 1e-4 of it, whose
    order is rounding), and the top `num_top` with ranks 1..num_top, best first, equal to HF's."""
    tol = 1e-4
    assert ours[0] is None and len(ours) == len(prompt)
    for position in range(1, len(prompt)):
        entry, ref, token = ours[position], reference[position - 1], prompt[position]
        assert entry is not None and token in entry, position
        logprob, rank = entry[token]
        assert abs(logprob - ref[token].item()) < tol, (position, logprob, ref[token].item())
        hf_rank = int((ref >= ref[token]).sum())
        ambiguous = int(((ref - ref[token]).abs() < tol).sum())  # itself included
        assert abs(rank - hf_rank) < ambiguous, (position, rank, hf_rank)
        top = sorted((r, tid, lp) for tid, (lp, r) in entry.items() if r <= num_top)
        assert [r for r, _, _ in top] == list(range(1, num_top + 1)), (position, entry)
        assert len(entry) == num_top + (rank > num_top), (position, entry)
        hf_top = ref.topk(num_top).values.tolist() if num_top else []
        for (_, tid, lp), hf_lp in zip(top, hf_top, strict=True):
            assert abs(lp - hf_lp) < tol and abs(lp - ref[tid].item()) < tol, (position, tid)
