"""What the tensor- and pipeline-parallel tests share: the comparison with the single-rank engine, their
tiny models and prompts, and the worker processes left running."""

from __future__ import annotations

import psutil
import torch

from tests import tiny_models

# Logprobs of a split model against the whole one: the partial sums of the row-parallel layers add up in
# another order under tensor parallel (pipeline stages alone compute the same bits).
TOLERANCE = 1e-4


def compare_runs(runs: list[tuple[list[list[int]], list[dict[int, float]]]], min_identical: int) -> None:
    """The single-rank run vs the split one (`greedy_with_first_logprobs` results): at least
    `min_identical` prompts with identical tokens, and every prompt's first-step top logprobs (the tokens
    both have) within TOLERANCE."""
    (tokens_1, first_1), (tokens_2, first_2) = runs
    identical = sum(a == b for a, b in zip(tokens_1, tokens_2, strict=True))
    assert identical >= min_identical, (identical, tokens_1, tokens_2)
    for one, two in zip(first_1, first_2, strict=True):
        common = one.keys() & two.keys()
        assert len(common) >= len(one) - 2  # (the last places may swap between near-equal logprobs)
        assert max(abs(one[t] - two[t]) for t in common) < TOLERANCE


def tiny_model(tmp_path, name: str, arch: str, extra: dict):
    """A tiny random model (tests/tiny_models.py) saved under tmp_path/name, its attention biases (if
    any) made large enough to matter (they start at zero)."""
    model = tiny_models.build(arch, **extra)
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            if proj.bias is not None:
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    return tmp_path / name


def random_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    # Lengths around block boundaries, past the sliding window, and one long enough to need chunks.
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 70)]


def worker_processes() -> list[psutil.Process]:
    """This process's parallel workers (named pagoda-tpN), left running."""
    return [p for p in psutil.Process().children() if p.name().startswith("pagoda-tp")]


def killed_worker_fails_the_next_step(config, message: str) -> None:
    """An engine with workers (`config`): after one step, SIGKILL its first worker; the next step raises
    WorkerDied matching `message` at once (not after the group's timeout), and closing the engine leaves
    no worker and no group directory."""
    import os
    import signal

    import pytest

    from pagoda.engine_core.engine import EngineCore
    from pagoda.engine_core.parallel.executor import WorkerDied
    from pagoda.engine_core.sampling_params import SamplingParams

    engine = EngineCore(config)
    try:
        engine.add_request("a", list(range(5, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()
        worker = engine.executor.ranks.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        with pytest.raises(WorkerDied, match=message):  # (raised at all: no step waits for ever on the dead rank)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()
    assert not os.path.exists(engine.executor.runtime_dir)
    assert worker_processes() == []


def shared_prefix_case():
    """Six prompts sharing a 40-token prefix, every other one owing prompt logprobs, 40 greedy tokens each:
    with a 14-block pool, the split engines' preemption, prefix-caching and prompt-logprob case."""
    from pagoda.engine_core.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 9, 20, 5, 14, 30)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
        for i in range(len(prompts))
    ]
    return prompts, params
