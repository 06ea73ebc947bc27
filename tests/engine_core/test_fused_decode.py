"""The fused CPU decode path (kernels/cpu/decoder.c, engine_core/models/fused_decode.py): a decode step's
layers in one C call compute what the layer-by-layer forward computes, on every architecture's tiny model.

Each decode step of a real engine runs the fused path, then the layer-by-layer forward on the same inputs
(which writes the same K/V to the same slots again), and the two outputs must agree to float rounding;
greedy tokens must then equal HF's. Pure-decode steps only: prefill and mixed steps never take the path.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from pagoda.kernels.cpu.decoder import FusedDecoder, LayerTensors, Shape
from tests import tiny_models
from tests.engine_core.fused_decode_checks import LayeredCheck
from tests.helpers import hf_greedy, run_engine


def _engine(model_dir, **args) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), max_num_batched_tokens=64, num_kv_blocks=64, **args))


# (Gemma's layer is not the C decoder's: tests/engine_core/test_gemma.py checks that it decodes layer by layer)
@pytest.mark.parametrize(
    "name", [n for n in tiny_models.ARCHITECTURES if n not in tiny_models.MOE + tiny_models.EAGER + tiny_models.QWEN3_5]
)
def test_fused_decode_matches_the_layers_and_hf(tmp_path, name):
    hf_model = tiny_models.build(name)
    hf_model.save_pretrained(tmp_path / name)
    gen = torch.Generator().manual_seed(2)
    # One decoding alone first, then five at once (contexts past the sliding window and a block boundary).
    single = [torch.randint(3, 512, (9,), generator=gen).tolist()]
    batch = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = _engine(tmp_path / name)
    with LayeredCheck(engine.runner.model) as check:
        tokens = run_engine(engine, single, params) + run_engine(engine, batch, params)
    assert check.calls >= 2 * 23 and {1, 5} <= check.batches  # (the fused path really ran)
    assert check.worst < 1e-4
    assert tokens == [hf_greedy(hf_model, p, 24, stop_at_eos=False) for p in single + batch]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_models_decode_layer_by_layer(tmp_path, name):
    """The C decoder runs dense MLPs only: a model with MoE layers (all, or all but one: qwen3_moe's
    dense layer 1) never takes the fused path, and its tokens still equal HF's."""
    hf_model = tiny_models.build(name)
    hf_model.save_pretrained(tmp_path / name)
    prompts = [[5, 17, 300, 41, 9], [7] * 20]
    engine = _engine(tmp_path / name)
    with LayeredCheck(engine.runner.model) as check:
        tokens = run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert check.calls == 0
    assert tokens == [hf_greedy(hf_model, p, 8, stop_at_eos=False) for p in prompts]


@pytest.mark.parametrize("change", ["sinks", "windows"])
def test_sinks_or_mixed_windows_decode_layer_by_layer(tmp_path, change):
    """The C decoder's attention has no sink term and one sliding window for every layer: a dense model
    given attention sinks, or layers of different windows (as gpt-oss has both), never takes the fused
    path."""
    tiny_models.build("llama").save_pretrained(tmp_path / "llama")
    engine = _engine(tmp_path / "llama")
    attention = engine.runner.model.attention_layers()[1]
    if change == "sinks":
        attention.sinks = torch.nn.Parameter(torch.zeros(attention.num_heads), requires_grad=False)
    else:
        attention.sliding_window = 4
    with LayeredCheck(engine.runner.model) as check:
        tokens = run_engine(engine, [[5, 17, 300, 41, 9]], SamplingParams(temperature=0.0, max_tokens=6))
    assert check.calls == 0 and len(tokens[0]) == 6


def test_large_activations_saturate_silu_like_torch(tmp_path):
    """Gates of +-hundreds: silu(g) -> g and -> -0 (the vector exp is clamped, and its 2^n split so that
    e^88 does not overflow the exponent)."""
    hf_model = tiny_models.build("llama")
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.mlp.gate_proj.weight.mul_(40.0)
    hf_model.save_pretrained(tmp_path / "big")
    prompts = [[5, 17, 300, 41, 9], [7] * 20]
    engine = _engine(tmp_path / "big")
    with LayeredCheck(engine.runner.model) as check:
        run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert check.calls and check.worst < 1e-4


def test_switched_off_by_the_environment(tmp_path, monkeypatch):
    tiny_models.build("llama").save_pretrained(tmp_path / "m")
    monkeypatch.setenv("PAGODA_DISABLE_FUSED_DECODE", "1")
    engine = _engine(tmp_path / "m")
    with LayeredCheck(engine.runner.model) as check:
        run_engine(engine, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert check.calls == 0


def test_a_long_prompts_short_chunk_keeps_its_bulk_linears(tmp_path, monkeypatch):
    """A step of short chunks attends as decodes, but a chunk of a long prompt holds bulk rows
    (BULK_PROMPT_TOKENS), whose linears (AMX where the CPU has it) the fused path does not run."""
    from pagoda.engine_core import model_runner

    monkeypatch.setattr(model_runner, "BULK_PROMPT_TOKENS", 20)
    tiny_models.build("llama").save_pretrained(tmp_path / "m")
    engine = EngineCore(EngineConfig(model=str(tmp_path / "m"), max_num_batched_tokens=16, num_kv_blocks=64))
    with LayeredCheck(engine.runner.model) as check:  # 24 tokens: chunks of 16 and 8
        run_engine(engine, [list(range(5, 29))], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    bulk = ops.bulk_rows_differ(torch.device("cpu"))  # (else no rows are bulk: the chunks may take the path)
    assert check.batches == ({1} if bulk else {1, 8, 16})


def test_the_decoder_refuses_layouts_it_cannot_read():
    """The C code reads raw pointers: a wrong shape or dtype is refused before it gets there."""
    from pagoda.kernels.panels import PanelWeight

    h, heads, kv_heads, d, inter = 64, 4, 2, 16, 128
    shape = Shape(hidden=h, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, intermediate=inter, eps=1e-5)

    def layer(**changes) -> LayerTensors:
        tensors = dict(
            input_norm=torch.ones(h),
            post_norm=torch.ones(h),
            qkv=PanelWeight.pack(torch.randn((heads + 2 * kv_heads) * d, h)),
            o=PanelWeight.pack(torch.randn(h, heads * d)),
            gate_up=PanelWeight.pack(torch.randn(2 * inter, h)),
            down=PanelWeight.pack(torch.randn(h, inter)),
            key_cache=torch.zeros(4, 16, kv_heads, d),
            value_cache=torch.zeros(4, 16, kv_heads, d),
        )
        return LayerTensors(**{**tensors, **changes})

    cos_sin = torch.zeros(128, d)
    FusedDecoder(shape, [layer()], cos_sin)  # (the right layouts are accepted)
    for bad in (
        dict(input_norm=torch.ones(h, dtype=torch.float64)),
        dict(down=PanelWeight.pack(torch.randn(h, inter + 1))),
        dict(key_cache=torch.zeros(4, 16, kv_heads + 1, d)),
        dict(value_cache=torch.zeros(4, 16, kv_heads, d).transpose(0, 1)),
        dict(q_norm=torch.ones(d)),  # (without k_norm)
    ):
        with pytest.raises(ValueError, match="layer 0"):
            FusedDecoder(shape, [layer(**bad)], cos_sin)
    decoder = FusedDecoder(shape, [layer()], cos_sin)
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden states"):
        decoder(ids, torch.zeros(2, h + 1), None, ids, torch.zeros(2, 1, dtype=torch.int64), ids + 1, 1)
    with pytest.raises(ValueError, match="one entry per sequence"):
        decoder(ids, torch.zeros(2, h), None, ids[:1], torch.zeros(2, 1, dtype=torch.int64), ids + 1, 1)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_decode_reads_and_writes_a_float16_kv_cache(tmp_path, name):
    """`--kv-cache-dtype float16`: the fused step writes K/V rounded to float16 and attends over them as the
    layers' kernels do (both read the same float16 cache, so they agree to float rounding)."""
    tiny_models.build(name).save_pretrained(tmp_path / name)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    engine = _engine(tmp_path / name, kv_cache_dtype="float16")
    assert engine.runner.kv_cache.dtype == torch.float16
    with LayeredCheck(engine.runner.model) as check:
        run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert check.calls >= 11 and 3 in check.batches
    assert check.worst < 1e-4


def _quantized_checkpoint(kind: str, tmp_path) -> tuple[str, dict]:
    """(model path, engine arguments) of each format whose weights load as 8-/4-bit PackedWeights."""
    from tests import gptq_awq_checkpoints, quant_checkpoints
    from tests.engine_core.gguf_files import smollm2_as

    if kind in ("int8", "int4"):  # (at load, on a model with QKV biases)
        tiny_models.build("qwen2").save_pretrained(tmp_path / "qwen2")
        return str(tmp_path / "qwen2"), {"quantization": kind}
    if kind == "gguf-q4_1":
        from pagoda.engine_core.default_model import ensure_default_gguf

        return str(ensure_default_gguf()), {}
    if kind == "gguf-q8_0":
        from gguf import GGMLQuantizationType

        return str(smollm2_as("Q8_0", lambda name: GGMLQuantizationType.Q8_0)), {}
    if kind.startswith(("gptq", "awq")):
        return str(gptq_awq_checkpoints.checkpoint(gptq_awq_checkpoints.BY_NAME[kind])), {}
    source, scheme = kind.removeprefix("ct-").split(":")
    return str(quant_checkpoints.checkpoint(source, scheme)), {}


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float-activations", "int8-activations"])
@pytest.mark.parametrize(
    "kind",
    [
        "int8",
        "int4",
        "gguf-q4_1",
        "gguf-q8_0",
        # (checkpoints made by the quantization tools' venvs, as the slow format tests make them)
        pytest.param("gptq-tiny-qwen2-w4-g64", marks=pytest.mark.slow),
        pytest.param("awq-tiny-mistral-g128", marks=pytest.mark.slow),
        pytest.param("ct-tiny-mistral:w8a16-asym", marks=pytest.mark.slow),
        pytest.param("ct-tiny-qwen2:w4a16-asym", marks=pytest.mark.slow),
    ],
)
def test_quantized_weights_decode_fused_as_the_layers_do(tmp_path, kind, int8_activations, request):
    """8- and 4-bit weights of every format run in the C decoder, each projection by the path the
    layer-by-layer forward takes for that batch (one row at a time, register tiles, int8 activations where
    the CPU has VNNI and they are switched on): the same numbers, so the same greedy tokens."""
    if int8_activations:
        request.getfixturevalue("int8_activations_on")
    model, args = _quantized_checkpoint(kind, tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 12, 17, 30, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = _engine(model, int8_activations=int8_activations, **args)
    with LayeredCheck(engine.runner.model) as check:
        tokens = run_engine(engine, prompts[:1], params) + run_engine(engine, prompts, params)
    engine.runner.model.fused_decode.enabled = False
    layered = run_engine(engine, prompts[:1], params) + run_engine(engine, prompts, params)
    assert check.calls >= 2 * 9 and {1, 5} <= check.batches  # (the fused path really ran)
    assert check.worst < 1e-4
    if not int8_activations:
        # (With int8 activations a 1-ulp difference between C's and torch's norms can round one activation to
        # the other side of a step, moving an output by a step's worth: a near-tie between two tokens can
        # then go either way, so there the per-step check above is the comparison.)
        assert tokens == layered
