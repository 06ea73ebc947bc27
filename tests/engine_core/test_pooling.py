"""The pooling engine (embedding models), in-process: a tiny random Qwen2 under `--runner pooling` against
HF's `AutoModel`, Matryoshka truncation, the default embedding model against sentence-transformers, its
int8 quantization, the scheduler's batching, and what each kind of engine refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_embedding_model import ensure_default_embedding_model
from pagoda.engine_core.engine import EngineCore, create_engine
from pagoda.engine_core.llm import LLM
from pagoda.engine_core.pooling.engine import PoolingEngineCore
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.pooling.scheduler import PoolingRequest, PoolingScheduler
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.validation import ParamError
from tests import tiny_models

LENGTHS = (1, 2, 7, 16, 33, 70)


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A tiny random Qwen2 (QKV biases that matter) saved with its LM head; HF's AutoModel on it."""
    model_dir = tmp_path_factory.mktemp("tiny") / "qwen2"
    tiny_models.build("qwen2", tie_word_embeddings=False).save_pretrained(model_dir)
    hf = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model_dir, hf


def _run(
    engine, prompts: list[list[int]], params: PoolingParams | list[PoolingParams] | None = None
) -> list[np.ndarray]:
    """Every prompt at once, so they share steps; each one's [rows, dim] output."""
    per_prompt = params if isinstance(params, list) else [params or PoolingParams()] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(str(i), prompt, pooling=p)
    out = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.finished and not delta.new_token_ids
            out[delta.request_id] = delta.pooled.array()
    engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))]


def _hf_hidden(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0]


def test_decoder_last_token_pooling_equals_hf_automodel(tiny_qwen2):
    model_dir, hf = tiny_qwen2
    config = EngineConfig(model=str(model_dir), runner="pooling", normalize=False, max_num_batched_tokens=96)
    engine = create_engine(config)
    assert isinstance(engine, PoolingEngineCore) and engine.pooler.pooling_type == "last"
    assert engine.runner.model.lm_head is None  # a pooling decoder loads no LM head
    prompts = _prompts()
    for prompt, ours in zip(prompts, _run(engine, prompts), strict=True):
        expected = _hf_hidden(hf, prompt)[-1]
        torch.testing.assert_close(torch.from_numpy(ours[0].copy()), expected, atol=1e-5, rtol=1e-4)


def test_decoder_token_and_mean_pooling_equal_hf(tiny_qwen2):
    model_dir, hf = tiny_qwen2
    engine = create_engine(EngineConfig(model=str(model_dir), runner="pooling", pooling_type="mean", normalize=False))
    prompts = _prompts(2)
    tokens = _run(engine, prompts, PoolingParams(task="token_embed"))
    means = _run(engine, prompts)
    tasks = ["embed", "token_embed"] * (len(prompts) // 2)
    mixed = _run(engine, prompts, [PoolingParams(task=task) for task in tasks])
    for i, out in enumerate(mixed):  # both tasks in one step: each request gets its own output
        np.testing.assert_allclose(out, (means, tokens)[i % 2][i], atol=1e-6)
    for prompt, rows, mean in zip(prompts, tokens, means, strict=True):
        hidden = _hf_hidden(hf, prompt)
        assert rows.shape == (len(prompt), hidden.shape[1])
        torch.testing.assert_close(torch.from_numpy(rows.copy()), hidden, atol=1e-5, rtol=1e-4)
        expected = hidden.mean(0)
        torch.testing.assert_close(torch.from_numpy(mean[0].copy()), expected, atol=1e-5, rtol=1e-4)


def test_matryoshka_dimensions_truncate_and_renormalize(tmp_path, tiny_qwen2):
    model_dir, _ = tiny_qwen2
    config = json.loads((model_dir / "config.json").read_text())
    declared = tmp_path / "matryoshka"
    declared.mkdir()
    for path in model_dir.iterdir():
        (declared / path.name).write_bytes(path.read_bytes())
    (declared / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 64, 128]}))
    engine = create_engine(EngineConfig(model=str(declared), runner="pooling"))
    prompts = _prompts(3)
    raw = _run(engine, prompts, PoolingParams(normalize=False))
    for dims in (32, 64):
        short = _run(engine, prompts, PoolingParams(dimensions=dims))
        for full, cut in zip(raw, short, strict=True):
            expected = full[0, :dims] / np.linalg.norm(full[0, :dims].astype(np.float64))
            assert cut.shape == (1, dims)
            np.testing.assert_allclose(cut[0], expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ParamError, match="dimensions") as refused:
        engine.add_request("x", [5, 6], pooling=PoolingParams(dimensions=48))  # not a declared size
    assert refused.value.param == "dimensions"
    plain = create_engine(EngineConfig(model=str(model_dir), runner="pooling"))
    with pytest.raises(ParamError, match="Matryoshka"):
        plain.add_request("x", [5, 6], pooling=PoolingParams(dimensions=32))


@pytest.fixture(scope="module")
def minilm():
    return ensure_default_embedding_model()


def test_default_embedding_model_equals_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    texts = ["Hello world", "Ça va? Größe, naïve café", "東京は日本の首都です。", "emoji 🎉🚀", ".", "x " * 200]
    with LLM(str(minilm)) as llm:
        outputs = llm.embed(texts, use_tqdm=False)
        assert llm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        with pytest.raises(ValueError, match="embedding model"):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    ours = np.array([o.outputs.embedding for o in outputs])
    reference = st.SentenceTransformer(str(minilm), device="cpu").encode(texts, convert_to_numpy=True)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)  # its Normalize module


def test_int8_quantization_applies_to_the_encoder(minilm):
    prompts = [[101, 7592, 2088, 102], [101, *range(2000, 2100), 102]]
    full = _run(create_engine(EngineConfig(model=str(minilm))), prompts)
    engine = create_engine(EngineConfig(model=str(minilm), quantization="int8"))
    assert engine.runner.quantization is not None
    assert engine.runner.weight_bytes < 0.75 * 86 * 2**20  # the linears shrank (the 46 MiB embedding did not)
    for a, b in zip(full, _run(engine, prompts), strict=True):
        assert float(a[0] @ b[0]) > 0.99


def test_scheduler_batches_whole_prompts_under_the_budget():
    scheduler = PoolingScheduler(max_num_batched_tokens=100, max_num_seqs=3)
    sizes = [60, 30, 20, 5, 5, 5, 100]
    for i, n in enumerate(sizes):
        scheduler.add_request(PoolingRequest(str(i), [1] * n, PoolingParams()))
    assert scheduler.abort("4")
    steps = []
    while scheduler.has_unfinished():
        steps.append([r.request_id for r in scheduler.schedule()])
        assert sum(len(r.prompt_token_ids) for r in scheduler.running) <= 100
        scheduler.finish()
    # Whole, within the budget and max_num_seqs; "2" does not fit what "0" and "1" leave, so it sits out
    # step 1 (where "3" fits) and leads step 2, where "6" does not fit and leads step 3.
    assert steps == [["0", "1", "3"], ["2", "5"], ["6"]]
    assert not scheduler.running and not scheduler.waiting


def test_scheduler_lets_client_requests_take_turns():
    """The inputs of one client request (one batch_id) take turns with other requests', one each, so a
    small request runs in the next step, not after a large batch; no input waits forever."""
    scheduler = PoolingScheduler(max_num_batched_tokens=100, max_num_seqs=8)
    big, other = PoolingParams(batch_id="big"), PoolingParams(batch_id="other")
    for i in range(6):
        scheduler.add_request(PoolingRequest(f"big{i}", [1] * 30, big))
    steps = [[r.request_id for r in scheduler.schedule()]]
    scheduler.finish()
    scheduler.add_request(PoolingRequest("small", [1] * 5, PoolingParams()))
    for i in range(2):
        scheduler.add_request(PoolingRequest(f"other{i}", [1] * 60, other))
    assert scheduler.abort("big4")
    while scheduler.has_unfinished():
        steps.append([r.request_id for r in scheduler.schedule()])
        assert sum(len(r.prompt_token_ids) for r in scheduler.running) <= 100
        scheduler.finish()
    assert steps == [
        ["big0", "big1", "big2"],  # alone: whole batches in arrival order, as many as fit
        ["big3", "small", "other0"],  # each batch's next input in turn
        ["big5", "other1"],  # (big5 leads: other0 and small were served after big3)
    ]
    assert not scheduler.waiting


def test_a_small_request_runs_beside_a_large_batch(tiny_qwen2):
    """In the engine: a one-input request added while a large batch runs finishes in the next step,
    beside part of that batch, and gets the same vector as alone."""
    model_dir, _ = tiny_qwen2
    engine = create_engine(EngineConfig(model=str(model_dir), runner="pooling", max_num_batched_tokens=64))
    prompts = _prompts(4)
    batch = PoolingParams(batch_id="batch")
    for i in range(8):
        engine.add_request(f"batch{i}", prompts[5][:30], pooling=batch)
    assert sorted(d.request_id for d in engine.step()) == ["batch0", "batch1"]
    engine.add_request("small", prompts[2], pooling=PoolingParams())
    second = {d.request_id: d.pooled.array() for d in engine.step()}
    assert set(second) == {"batch2", "small"}  # the small request beside the batch's next input
    assert engine.has_unfinished_requests()  # five of the batch's inputs still to run
    alone = _run(engine, [prompts[2]])[0]
    np.testing.assert_allclose(second["small"], alone, atol=1e-6)


def test_each_engine_refuses_the_other_kind_and_bad_inputs(tmp_path, minilm):
    pooling = create_engine(EngineConfig(model=str(minilm)))
    with pytest.raises(ParamError, match="embedding model") as refused:
        pooling.add_request("g", [101, 102], SamplingParams())
    assert refused.value.param == "model"
    for bad, param in (([], "input"), ([101] * 257, "input"), ([10**6], "input")):
        with pytest.raises(ParamError) as refused:
            pooling.add_request("b", bad, pooling=PoolingParams())
        assert refused.value.param == param
    with pytest.raises(ParamError, match="task"):
        pooling.add_request("t", [101, 102], pooling=PoolingParams(task="classify"))
    assert not pooling.has_unfinished_requests()

    model_dir = tmp_path / "llama"
    tiny_models.build("llama").save_pretrained(model_dir)
    generating = create_engine(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    assert isinstance(generating, EngineCore)
    with pytest.raises(ParamError, match="not an embedding model"):
        generating.add_request("p", [5, 6], SamplingParams(), pooling=PoolingParams())
    with pytest.raises(ValueError, match="encoder"):
        EngineCore(EngineConfig(model=str(minilm), runner="generate"))
    with pytest.raises(ValueError, match="one process"):
        create_engine(EngineConfig(model=str(minilm), tensor_parallel_size=2))


def test_the_engine_process_knows_before_torch_loads_whether_it_pools(tmp_path, minilm):
    """(It then has OpenMP threads sleep rather than spin while they wait: engine_core/environment.py.)"""
    from pagoda.engine_core.pooling.config import will_pool

    assert will_pool(EngineConfig(model=str(minilm)))
    assert not will_pool(EngineConfig(model=str(minilm), runner="generate"))
    assert will_pool(EngineConfig(model="some/hub-id", runner="pooling"))
    assert not will_pool(EngineConfig(model="some/hub-id")) and not will_pool(EngineConfig())
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert not will_pool(EngineConfig(model=str(tmp_path)))
