"""`--kv-cache-dtype`: a float16 KV cache under a float32 model on the CPU (half the memory per token),
refused where the cache already holds the model's dtype. Its numerics are checked elsewhere: the
kernels against the torch reference (tests/kernels/test_cpu_kernels.py), the fused decode step
(test_fused_decode.py) and SmolLM2's greedy tokens against HF (test_golden_smollm2.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig, resolve_kv_cache_dtype
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.helpers import run_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_cache_dtype_follows_the_model_unless_float16_is_asked_for_on_the_cpu():
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CUDA) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, CPU) == torch.float16
    assert resolve_kv_cache_dtype("float16", torch.float16, CUDA) == torch.float16  # (the model's own)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float16 is for the CPU.*bfloat16.*--dtype"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, CUDA)
    with pytest.raises(ValueError, match=r"needs a float32 model on the CPU \(--dtype float32\)"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, CPU)  # (its cache is 16-bit already)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16"):
        EngineConfig(kv_cache_dtype="int8")


def test_a_float16_cache_holds_twice_the_blocks_and_serves_requests_without_leaking_them(tmp_path):
    tiny_models.build("llama").save_pretrained(tmp_path / "llama")
    blocks = {}
    for dtype in ("auto", "float16"):
        engine = EngineCore(EngineConfig(model=str(tmp_path / "llama"), kv_cache_dtype=dtype, kv_cache_memory=2**20))
        blocks[dtype] = engine.runner.num_blocks
        assert engine.runner.kv_cache.dtype == (torch.float32 if dtype == "auto" else torch.float16)
        prompts = [[5, 6, 7] * n for n in (1, 9, 30)]  # (run_engine checks that every block comes back)
        tokens = run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert [len(t) for t in tokens] == [20, 20, 20]
        engine.close()
    assert blocks["float16"] == 2 * blocks["auto"]
