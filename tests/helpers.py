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
