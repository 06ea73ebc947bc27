"""Prefix caching for models with recurrent layers (Qwen3.5, on tests/tiny_models.py's qwen3_5 and
qwen3_5_moe): their states are snapshotted at prompt block boundaries (engine_core/state_snapshots.py) every
512 tokens and at a prompt's last boundary, and a request resumes a cached prefix from the snapshot at its
resume point. A shared 1,024-token prefix is computed once and the next request's tokens equal HF's and an
uncached engine's; a next turn (the last prompt, its answer and more) resumes at the last prompt's last
boundary; prompt chunks end at the snapshot points; a pool of one snapshot keeps the latest and the tokens
stay right when a lookup misses; preemption and aborts leak nothing."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.state_snapshots import StateSnapshots
from tests import tiny_models
from tests.helpers import hf_greedy, run_engine

NEW_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=tiny_models.QWEN3_5)
def saved(request, tmp_path_factory):
    """The model with its Gated DeltaNet layers' decay made slow (A_log about log 0.01, where HF draws about
    2: a state then fades within a few tokens), so that a state resumed wrongly changes the tokens for
    hundreds of positions."""
    model = tiny_models.build(request.param, max_position_embeddings=2048)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.copy_(torch.empty_like(parameter).uniform_(0.005, 0.02).log())
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path)
    return model, path


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path, **args) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), **{"num_kv_blocks": 256, **args}))


def test_a_shared_1024_token_prefix_is_computed_once(saved):
    """The second request resumes after the prefix (the snapshot at 1,024): only its own 30 tokens are
    computed, and its tokens are HF's and an uncached engine's."""
    hf_model, path = saved
    prefix = _tokens(1024, 1)
    prompts = [prefix + _tokens(40, 2), prefix + _tokens(30, 3)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(path)
    assert run_engine(engine, prompts[:1], PARAMS) == want[:1]
    assert engine.kv_manager.snapshots is not None and len(engine.kv_manager.snapshots) == 3  # (512, 1024, 1056)
    hits = engine.scheduler.stats().prefix_cache_hits
    assert run_engine(engine, prompts[1:], PARAMS) == want[1:]
    assert engine.scheduler.stats().prefix_cache_hits - hits == 1024
    assert engine.kv_manager.snapshots.loaded == 1
    uncached = _engine(path, enable_prefix_caching=False)
    assert run_engine(uncached, prompts, PARAMS) == want
    engine.check_integrity()


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_every_rank_resumes_its_share_of_the_state(saved, split):
    """TP=2 (each rank its heads' states) and PP=2 (each stage its layers'): every rank keeps and loads the
    snapshots of what it holds (the copies travel with the step); the resumed request's tokens are HF's."""
    hf_model, path = saved
    prefix = _tokens(512, 13)
    prompts = [prefix + _tokens(20, 14), prefix + _tokens(3, 15)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(path, cpu_threads_bind="none", **split)
    try:
        assert run_engine(engine, prompts[:1], PARAMS) + run_engine(engine, prompts[1:], PARAMS) == want
        assert engine.kv_manager.snapshots.loaded == 1
    finally:
        engine.close()


def test_a_next_turn_resumes_at_the_last_prompts_last_boundary(saved):
    """Turn two is turn one's prompt (600 tokens), its answer and 20 more tokens: it resumes at 592, the last
    block boundary before turn one's last prompt token."""
    hf_model, path = saved
    engine = _engine(path)
    first = _tokens(600, 4)
    answer = run_engine(engine, [first], PARAMS)[0]
    second = first + answer + _tokens(20, 5)
    hits = engine.scheduler.stats().prefix_cache_hits
    assert run_engine(engine, [second], PARAMS) == [hf_greedy(hf_model, second, NEW_TOKENS, stop_at_eos=False)]
    assert engine.scheduler.stats().prefix_cache_hits - hits == 592


def test_prompt_chunks_end_where_states_are_kept(saved):
    """A 1,100-token prompt under a 2,048-token budget runs as 512, 512, 64 and 12 tokens: snapshots at 512
    and 1,024 and at its last boundary, 1,088."""
    _, path = saved
    engine = _engine(path)
    engine.add_request("r", _tokens(1100, 6), PARAMS)
    chunks = []
    while engine.scheduler.requests["r"].num_output_tokens == 0:
        before = engine.scheduler.requests["r"].num_computed_tokens
        engine.step()
        chunks.append(engine.scheduler.requests["r"].num_computed_tokens - before)
    assert chunks == [512, 512, 64, 12]
    assert engine.kv_manager.snapshots.saved == 3


def test_a_pool_of_one_snapshot_keeps_the_latest(saved):
    """With one row each request's last snapshot evicts the others: a request sharing the first's 1,056
    prompt tokens resumes there; then one sharing only 1,024 finds nothing to resume from and computes its
    whole prompt, with the right tokens."""
    hf_model, path = saved
    prefix = _tokens(1056, 7)
    prompts = [prefix + _tokens(8, 8), prefix + _tokens(20, 10), prefix[:1024] + _tokens(50, 9)]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    engine = _engine(path, recurrent_state_snapshots=1)
    got, hits = [], []
    for prompt in prompts:
        before = engine.scheduler.stats().prefix_cache_hits
        got += run_engine(engine, [prompt], PARAMS)
        hits.append(engine.scheduler.stats().prefix_cache_hits - before)
    assert got == want
    assert hits == [0, 1056, 0]
    engine.check_integrity()


def test_preemption_and_aborts_leak_nothing(saved):
    """Requests in a pool too small for all of them (preempted ones recompute, resuming from their own
    snapshots where those are still kept), one aborted mid-prompt: tokens stay HF's, and the blocks, slots
    and snapshot rows are all back at the end."""
    hf_model, path = saved
    prompts = [_tokens(n, 20 + n) for n in (100, 150, 120, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in prompts]
    engine = _engine(path, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    engine.add_request("doomed", _tokens(200, 99), params)
    engine.step()
    engine.abort_request("doomed")
    assert run_engine(engine, prompts, params) == want
    assert engine.scheduler.num_preemptions_total > 0
    engine.check_integrity()
    assert engine.kv_manager.num_owned_requests == 0
    assert engine.kv_manager.states.num_free == engine.kv_manager.states.num_slots


def test_the_snapshot_rows_are_reused_least_recently_used_first():
    snapshots = StateSnapshots(2, first_row=5)
    assert snapshots.reserve(b"a") == 5 and snapshots.reserve(b"b") == 6
    snapshots.begin_step()
    assert snapshots.reserve(b"a") is None  # (kept already; now the most recently used)
    assert snapshots.reserve(b"c") == 6  # (b was the least recently used)
    snapshots.begin_step()
    assert snapshots.lookup(b"b") is None and snapshots.lookup(b"a") == 5
    assert snapshots.reserve(b"d") == 6  # (c: a was just looked up)
    snapshots.check_integrity()
    assert snapshots.reset() == 2 and len(snapshots) == 0
    snapshots.check_integrity()


def test_one_step_never_copies_two_states_into_one_row():
    """More saves in a step than rows: the extra ones are dropped, not copied over a row this step fills."""
    snapshots = StateSnapshots(2, first_row=5)
    snapshots.begin_step()
    assert [snapshots.reserve(h) for h in (b"a", b"b", b"c")] == [5, 6, None]
    snapshots.begin_step()
    assert snapshots.reserve(b"c") == 5  # (a, the least recently used, now goes)
    snapshots.check_integrity()


def test_a_burst_of_prompts_saves_each_state_in_its_own_row(saved):
    """Six short prompts admitted in one step with two snapshot rows: that step's saves go to distinct rows
    (the scheduler's outputs observed as the engine runs them), and each kept snapshot gives back its own
    prompt's state: longer prompts resuming from them get HF's tokens."""
    hf_model, path = saved
    prompts = [_tokens(20, 30 + i) for i in range(6)]
    engine = _engine(path, recurrent_state_snapshots=2)
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args, **kwargs: steps.append(schedule(*args, **kwargs)) or steps[-1]
    run_engine(engine, prompts, PARAMS)
    assert len(steps[0].requests) == 6
    destinations = [row for _, row in steps[0].state_saves]
    assert len(destinations) == 2 and len(set(destinations)) == 2
    resumed = [prompt + _tokens(3, 50) for prompt in prompts[:2]]
    want = [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in resumed]
    assert run_engine(engine, resumed, PARAMS) == want
