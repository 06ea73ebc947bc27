"""Phi-3 GGUF files (llama.cpp's architecture "phi3": fused attn_qkv and ffn_up, LongRoPE's factors as tensors,
partial rotary as rope.dimension_count; engine_core/gguf_phi3.py) written with the `gguf` package from the tiny
random models of tests/engine_core/test_phi3.py, then served directly: greedy tokens equal Hugging Face's model
with the same weights, within the original context (an engine of at most 64 positions: LongRoPE's short factors)
and past it (the long ones). Serving a file converts its tokenizer (SmolLM2's) first: those tests are slow."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize, quantize

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.gguf_model import read_gguf
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.engine_core.gguf_files import write_gguf
from tests.engine_core.phi3_variants import ORIGINAL, VARIANTS
from tests.helpers import hf_greedy, run_engine

T = GGMLQuantizationType
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
VOCAB = 49152  # SmolLM2's: the file carries its tokenizer
_BLOCK = {  # Hugging Face module inside layer N -> llama.cpp's tensor inside blk.N
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",  # (gate rows, then up rows)
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def q4_1_reader():
    return GGUFReader(str(ensure_default_gguf()))  # (its metadata: SmolLM2's tokenizer and chat template)


def _tensors(model, linear_type) -> list:
    """The model's weights under llama.cpp's names, its linears stored as `linear_type`, the rest F32."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    scaling = model.config.rope_parameters
    out = [
        ("token_embd.weight", state.pop("model.embed_tokens.weight"), T.F32),
        ("output_norm.weight", state.pop("model.norm.weight"), T.F32),
        ("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32), T.F32),
        ("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32), T.F32),
    ]
    if not model.config.tie_word_embeddings:
        out.append(("output.weight", state.pop("lm_head.weight"), T.F32))
    state.pop("lm_head.weight", None)
    for key, value in state.items():
        layer, _, rest = key.removeprefix("model.layers.").partition(".")
        module, _, kind = rest.rpartition(".")
        out.append((f"blk.{layer}.{_BLOCK[module]}.{kind}", value, T.F32 if value.ndim == 1 else linear_type))
    return out


def _overrides(model, reader) -> dict:
    """The Q4_1 file's `llama.*` keys as `phi3.*`, with the tiny model's sizes and Phi-3's keys."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    sizes = {
        ".embedding_length": cfg.hidden_size,
        ".feed_forward_length": cfg.intermediate_size,
        ".block_count": cfg.num_hidden_layers,
        ".attention.head_count": cfg.num_attention_heads,
        ".attention.head_count_kv": cfg.num_key_value_heads,
        ".rope.dimension_count": int(head_dim * cfg.rope_parameters["partial_rotary_factor"]),
        ".context_length": cfg.max_position_embeddings,
        ".rope.scaling.original_context_length": ORIGINAL,
        ".attention.sliding_window": cfg.sliding_window,
    }
    out = {"phi3" + key: (value, U32) for key, value in sizes.items()}
    for field_name, field in reader.fields.items():
        if field_name.startswith("llama.") and "phi3" + field_name.removeprefix("llama") not in out:
            out["phi3" + field_name.removeprefix("llama")] = (field.contents(), field.types[0])
    scale = cfg.max_position_embeddings / ORIGINAL  # (the converter's attention factor)
    out["phi3.rope.scaling.attn_factor"] = (float(np.sqrt(1 + np.log(scale) / np.log(ORIGINAL))), F32)
    out["phi3.rope.freq_base"] = (float(cfg.rope_parameters["rope_theta"]), F32)
    out["phi3.attention.layer_norm_rms_epsilon"] = (float(cfg.rms_norm_eps), F32)
    out["general.architecture"] = ("phi3", GGUFValueType.STRING)
    return out


def _write(tmp_path, reader, variant: str, linear_type=T.F32):
    model = tiny_models.build("phi3", vocab_size=VOCAB, **VARIANTS[variant])
    path = tmp_path / f"tiny-{variant}.gguf"
    write_gguf(path, reader, _tensors(model, linear_type), _overrides(model, reader))
    return model, path


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_config_says_what_the_file_holds(tmp_path, q4_1_reader, variant):
    model, path = _write(tmp_path, q4_1_reader, variant)
    config = read_gguf(path).config
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["head_dim"] == 16
    assert config["partial_rotary_factor"] == model.config.rope_parameters["partial_rotary_factor"]
    assert config["sliding_window"] == 24 and config["tie_word_embeddings"] == model.config.tie_word_embeddings
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL
    for kind in ("short_factor", "long_factor"):
        assert scaling[kind] == pytest.approx(model.config.rope_parameters[kind], rel=1e-6)


def _serve(path, prompts: list[list[int]], max_tokens: int, **engine_args) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=64 * 1024**2, **engine_args))
    try:
        return run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        del engine
        gc.collect()


def _prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_float_file_serves_like_the_hugging_face_model(tmp_path, q4_1_reader, variant):
    model, path = _write(tmp_path, q4_1_reader, variant)
    short, long = _prompts(5, 30), _prompts(80)
    ours = _serve(path, short, 24, max_model_len=ORIGINAL) + _serve(path, long, 16, max_num_batched_tokens=48)
    with torch.no_grad():
        reference = [hf_greedy(model, p, 24, stop_at_eos=False) for p in short]
        reference += [hf_greedy(model, p, 16, stop_at_eos=False) for p in long]
    assert ours == reference


@pytest.mark.slow
def test_quantized_linears_serve_like_hf_on_their_dequantized_weights(tmp_path, q4_1_reader):
    """Fused attn_qkv and ffn_up stored Q8_0 load as INT8 (GGUF's blocks copied) and are cut into the merged
    parts: the tokens of Hugging Face's model holding the file's dequantized weights."""
    model, path = _write(tmp_path, q4_1_reader, "phi3", T.Q8_0)
    prompts = _prompts(70, 90)
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=64 * 1024**2))
    qkv = engine.runner.model.decoder_layers()[0].self_attn.qkv_proj
    assert qkv.quantized is not None and qkv.quantized.bits == 8
    del engine
    gc.collect()
    ours = _serve(path, prompts, 16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.layers.") and param.dim() == 2:
                array = param.detach().numpy()
                blocks = quantize(np.ascontiguousarray(array), T.Q8_0)
                param.copy_(torch.from_numpy(dequantize(blocks, T.Q8_0).reshape(array.shape)))
        reference = [hf_greedy(model, p, 16, stop_at_eos=False) for p in prompts]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= len(prompts) - 1
