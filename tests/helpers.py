"""Test helpers: run an EngineCore to completion, and HF greedy references."""

from __future__ import annotations

import torch

from engine_core.sampling_params import SamplingParams


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
