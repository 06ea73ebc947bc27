"""The timed part of an offline throughput run, shared by Pagoda's and vLLM's (their `LLM` classes take
the same calls). Imports nothing, so that vLLM's venv can load it too (benchmarks/peers/vllm_offline.py)."""

from __future__ import annotations

import time


def timed_generate(llm, prompts: list, params: list, warm_up_params, work: list[tuple[list[int], int]]) -> dict:
    """Warm up on two prompts, forget them, then time `llm.generate(prompts, params)`; every request must
    return exactly its output length (`work`: (prompt token ids, output length) per request)."""
    llm.generate(prompts[:2], warm_up_params, use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts must not be cache hits in the timed run
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(n for _, n in work), "every request must produce exactly its output length"
    in_tokens = sum(len(p) for p, _ in work)
    return {"seconds": elapsed, "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed}
