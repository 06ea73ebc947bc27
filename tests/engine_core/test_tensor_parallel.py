"""Tensor parallel on the CPU: real worker processes joined over gloo, compared with the single-rank engine.

Greedy tokens and first-step logprobs of TP=2 against TP=1 (the partial sums of the row-parallel layers
add up in another order, so logprobs agree to 1e-4 rather than bit for bit), on SmolLM2 (9 heads over 2
ranks: an uneven split), tiny random Mistral / Qwen2 / Qwen3 models, one with a single K/V head (held by
both ranks), one with attention biases, and quantized weights (int4 at load, the default model's Q4_1
GGUF file, an act-order GPTQ checkpoint). Then the
scheduler's paths (preemption, prefix caching, prompt logprobs) under TP, and the lifecycle: a killed
engine process takes its worker along, a killed worker makes the engine report itself dead.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from pagoda.api_proc.bench.local_server import alive, wait_until
from pagoda.engine_core import protocol
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.engine import EngineCore
from tests.engine_process import EngineProcess
from tests.helpers import golden_prompts, greedy_with_first_logprobs, run_engine
from tests.parallel_checks import (
    compare_runs,
    killed_worker_fails_the_next_step,
    random_prompts,
    shared_prefix_case,
    tiny_model,
    worker_processes,
)


def _tp1_and_tp2(model_dir, prompts, **engine_args):
    return [greedy_with_first_logprobs(model_dir, prompts, 32, tensor_parallel_size=tp, **engine_args) for tp in (1, 2)]


@pytest.mark.slow
def test_smollm2_golden_prompts(default_model_dir, tokenizer):
    prompts = golden_prompts(tokenizer)
    compare_runs(_tp1_and_tp2(default_model_dir, prompts, num_kv_blocks=512), min_identical=9)


@pytest.mark.slow
def test_gguf_q4_1_file(tokenizer):
    """The default model's own GGUF file (Q4_1 linears, loaded losslessly as INT4 groups of 32): each rank
    cuts its rows and columns, with their groups, from the converted weights."""
    prompts = golden_prompts(tokenizer)[:5]
    compare_runs(_tp1_and_tp2(ensure_default_gguf(), prompts, num_kv_blocks=256), min_identical=4)


# name -> (tests/tiny_models.py architecture, what differs)
TINY = {
    "mistral": ("mistral", {}),  # sliding window of 24 tokens
    "qwen2": ("qwen2", {}),  # QKV biases (split with their rows), tied embeddings
    "qwen3": ("qwen3", {}),  # per-head q/k norm, head_dim 32
    "llama-one-kv-head": ("llama", dict(num_key_value_heads=1)),  # held by both ranks
    # Biases on q/k/v (split with their rows) and on o_proj (row-parallel: added once, after the sum)
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_architectures(tmp_path, name):
    model_dir = tiny_model(tmp_path, name, *TINY[name])
    compare_runs(
        _tp1_and_tp2(model_dir, random_prompts(), max_num_batched_tokens=48, num_kv_blocks=64), min_identical=4
    )


def test_int4_at_load(tmp_path):
    """Quantization at load: each linear quantized whole (groups of 32, the LM head int8 per channel), then
    cut; the down projection's 256 input columns give each rank 4 whole groups."""
    model_dir = tiny_model(tmp_path, "llama", "llama3", {})
    runs = _tp1_and_tp2(model_dir, random_prompts(), quantization="int4", max_num_batched_tokens=48, num_kv_blocks=64)
    compare_runs(runs, min_identical=4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tp"), "llama", "llama3", {})


def test_preemption_prefix_caching_and_prompt_logprobs(tiny_llama):
    """A KV pool too small for every request at once (preemption, recompute), prompts sharing a prefix
    (cache hits), and prompt logprobs (the LM head on prompt rows, which the worker must join too): the
    tokens equal TP=1's exactly."""
    prompts, params = shared_prefix_case()
    results, stats = [], []
    for tp in (1, 2):
        engine = EngineCore(
            EngineConfig(model=str(tiny_llama), num_kv_blocks=14, max_num_batched_tokens=64, tensor_parallel_size=tp)
        )
        try:
            results.append(run_engine(engine, prompts, params))
            stats.append((engine.num_preemptions, engine.kv_manager.prefix_cache_hits))
        finally:
            engine.close()
    assert results[1] == results[0]
    preemptions, hits = stats[1]
    assert preemptions > 0 and hits > 0, stats


def test_models_that_do_not_split_fail_before_any_worker_starts(tiny_llama):
    with pytest.raises(ValueError, match="cannot split 8 attention heads with 2 key/value heads"):
        EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, tensor_parallel_size=3))
    assert worker_processes() == []


def test_a_quantization_group_split_between_ranks_is_named(tmp_path):
    """int4's groups of 32 cannot split 96 MLP columns over 2 ranks (48 each): a clear error at load, and
    the worker that failed the same way is gone."""
    model_dir = tiny_model(tmp_path, "llama", "llama", dict(intermediate_size=96))
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 gives each rank 48 .* group size 32"):
        EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16, quantization="int4", tensor_parallel_size=2))
    assert worker_processes() == []


def test_a_killed_worker_fails_the_next_step(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=32, tensor_parallel_size=2)
    killed_worker_fails_the_next_step(config, r"tensor-parallel rank 1 .* killed by signal 9")


class TPEngineProcess(EngineProcess):
    """The engine core in its own process, under tensor parallel (its worker is its only child)."""

    def worker(self) -> psutil.Process:
        (worker,) = psutil.Process(self.process.pid).children()
        return worker


def _tp_dirs(tmp_path) -> list[str]:
    return [name for name in os.listdir(tmp_path) if name.startswith("pagoda-tp-")]


@pytest.fixture
def engine_process(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the group's runtime directory goes here, to be checked
    engine = TPEngineProcess(tmp_path, EngineConfig(model=str(tiny_llama), num_kv_blocks=32, tensor_parallel_size=2))
    assert isinstance(engine.recv(), protocol.EngineReady)
    assert len(_tp_dirs(tmp_path)) == 1
    yield engine
    engine.close()


def test_kill_9_of_the_engine_process_takes_its_worker_along(engine_process, tmp_path):
    worker = engine_process.worker().pid
    os.kill(engine_process.process.pid, signal.SIGKILL)
    # Gone within 2 s of its parent. An exited worker stays a zombie until init reaps it, which a busy
    # host's init may take seconds to do: `alive` counts a zombie as dead, as the other lifecycle tests do.
    assert wait_until(lambda: not alive(worker), 2.0)
    assert _tp_dirs(tmp_path) == []  # the orphaned worker removed the group's directory


def test_a_killed_worker_makes_the_idle_engine_process_report_dead(engine_process, tmp_path):
    engine_process.worker().kill()
    message = engine_process.recv(timeout_s=10)
    assert isinstance(message, protocol.EngineDead) and "tensor-parallel rank 1" in message.message
    engine_process.process.join(10)
    assert engine_process.process.exitcode == 1
    assert _tp_dirs(tmp_path) == []


@pytest.mark.slow
def test_gptq_act_order_checkpoint(tokenizer):
    """A GPTQ checkpoint of SmolLM2's first layers quantized in activation order (groups of 64 scattered over the input
    columns): the row-parallel layers regroup each rank's columns (engine_core/quantization/base.py)."""
    from tests.gptq_awq_checkpoints import BY_NAME, checkpoint

    model_dir = checkpoint(BY_NAME["gptq-smollm2-4layers-w4-g64-actorder"])
    prompts = golden_prompts(tokenizer)[:5]
    compare_runs(_tp1_and_tp2(model_dir, prompts, num_kv_blocks=256), min_identical=4)
