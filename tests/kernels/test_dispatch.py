"""The dispatcher: one function per op, torch/C on the CPU, Triton on CUDA with the reference's signature;
and the whole model run on the Triton kernels (through the interpreter here) gives the torch path's
greedy tokens, eager and through the padded CUDA-graph decode buffers."""

from __future__ import annotations

import inspect

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from tests import tiny_models
from tests.helpers import run_engine

pytest.importorskip("triton")

NAMES = sorted(ops._TORCH)
CUDA_NAMES = sorted(set(ops._TORCH) - ops._CPU_ONLY)


def _positional(fn) -> list[str]:
    """The parameters a caller may pass by position (fused_moe's Triton kernel also takes keyword options,
    which it hands to the reference)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


@pytest.mark.parametrize("name", CUDA_NAMES)
def test_cuda_kernel_has_the_reference_signature(name):
    """Each op's CUDA kernel is Triton's, or torch's own where it has a better one (FP8 GEMMs)."""
    cuda_fn, reference = ops._resolve.__wrapped__(name, "cuda"), ops._TORCH[name]
    assert cuda_fn.__module__.startswith("pagoda.kernels.triton.") or cuda_fn is ops._CUDA_NATIVE.get(name)
    assert cuda_fn is not reference
    assert _positional(cuda_fn) == _positional(reference)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_tensors_never_reach_triton(name):
    assert not ops.implementation(name, torch.device("cpu")).__module__.startswith("pagoda.kernels.triton")


@pytest.fixture(params=["llama", "gemma4"])
def tiny_model(tmp_path, request):
    """A Llama, and a Gemma 4 (KV groups of two K/V shapes, KV-shared layers, proportional rope)."""
    layers = {"num_hidden_layers": 2} if request.param == "llama" else {}
    model = tiny_models.build(request.param, vocab_size=256, max_position_embeddings=512, **layers)
    model.save_pretrained(tmp_path / request.param)
    return tmp_path / request.param


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU check runs the model on Triton for real")
def test_model_on_triton_kernels_gives_the_torch_tokens(tiny_model, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    # Lengths around block boundaries and one that needs several chunks over its own prefix (for the Gemma,
    # slower in the interpreter with its six layers, fewer: past its 8-token window, in 16-token chunks).
    lengths, chunk = ((1, 15, 16, 33, 90), 40) if tiny_model.name == "llama" else ((1, 9, 20), 16)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model), max_num_batched_tokens=chunk, num_kv_blocks=48, max_model_len=256)
    expected = run_engine(EngineCore(config), prompts, params)

    on_cpu = ops.implementation  # (the CPU-only ops, the float32 panel linear, stay where they are)
    monkeypatch.setattr(
        ops,
        "implementation",
        lambda name, device: on_cpu(name, device) if name in ops._CPU_ONLY else ops._triton(name),
    )
    assert run_engine(EngineCore(config), prompts, params) == expected
    engine = EngineCore(config)
    engine.runner.enable_decode_graphs(engine.max_model_len, capture=False)  # padded decode batches
    assert run_engine(engine, prompts, params) == expected


@pytest.mark.parametrize("name", sorted(ops._CPU_ONLY))
def test_a_cpu_only_op_on_cuda_tensors_is_the_reference(name):
    """No Triton kernel to find: a CUDA tensor gets the torch reference, never an AttributeError."""
    assert ops._resolve.__wrapped__(name, "cuda") is ops._TORCH[name]
