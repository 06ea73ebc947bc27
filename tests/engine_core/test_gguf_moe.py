"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, and Mixtral's `llama` with an expert_count): written
with the `gguf` package, in llama.cpp's names and layout, from the tiny random Hugging Face models of
tests/tiny_models.py, then served directly; greedy tokens equal Hugging Face's model with the same weights."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.gguf_model import read_gguf
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.engine_core.gguf_files import write_gguf
from tests.helpers import hf_greedy, run_engine

T = GGMLQuantizationType
U32 = GGUFValueType.UINT32
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TEXTS = ["Hello world", " The capital of France is", "déjà vu 🤖 naïve", "<|im_start|>user\nhi<|im_end|>\n"]
VOCAB = 49152  # SmolLM2's: the file carries its tokenizer
# tiny model -> GGUF architecture (Mixtral's files say llama, with an expert_count); tiny_models.MOE's gpt_oss
# has names, metadata and MXFP4 experts of its own: test_gguf_gpt_oss.py
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_BLOCK = {  # Hugging Face module inside layer N -> llama.cpp's tensor inside blk.N
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


@pytest.fixture(scope="module")
def q4_1_reader():
    return GGUFReader(str(ensure_default_gguf()))  # (its metadata: SmolLM2's tokenizer and chat template)


def _llama_cpp_order(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for the llama architecture (interleaved rotary halves)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tensors(model, name: str, expert_type) -> list:
    """The model's weights under llama.cpp's names: experts stacked per layer as ffn_{gate,up,down}_exps
    (stored as `expert_type`), everything else F32."""
    cfg, arch = model.config, GGUF_ARCH[name]
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = [
        ("token_embd.weight", state.pop("model.embed_tokens.weight"), T.F32),
        ("output_norm.weight", state.pop("model.norm.weight"), T.F32),
        ("output.weight", state.pop("lm_head.weight"), T.F32),
    ]
    for key, value in state.items():
        layer, _, rest = key.removeprefix("model.layers.").partition(".")
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(value, 2, axis=1)
            out += [(blk + "ffn_gate_exps.weight", gate, expert_type), (blk + "ffn_up_exps.weight", up, expert_type)]
            continue
        if rest == "mlp.experts.down_proj":
            out.append((blk + "ffn_down_exps.weight", value, expert_type))
            continue
        module, _, kind = rest.rpartition(".")
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            value = _llama_cpp_order(value, heads)
        if module == "mlp.shared_expert_gate":
            value = value.reshape(-1)  # (a vector in llama.cpp's files)
        out.append((blk + f"{_BLOCK[module]}.{kind}", value, T.F32))
    return out


def _overrides(model, name: str, reader) -> dict:
    """The Q4_1 file's `llama.*` keys under the architecture's prefix, with the tiny model's sizes."""
    cfg, arch = model.config, GGUF_ARCH[name]
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    sizes = {
        ".embedding_length": cfg.hidden_size,
        ".feed_forward_length": cfg.intermediate_size,
        ".block_count": cfg.num_hidden_layers,
        ".attention.head_count": cfg.num_attention_heads,
        ".attention.head_count_kv": cfg.num_key_value_heads,
        ".attention.key_length": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        ".rope.dimension_count": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        ".context_length": 512,
        ".expert_count": experts,
        ".expert_used_count": cfg.num_experts_per_tok,
    }
    if name != "mixtral":
        sizes[".expert_feed_forward_length"] = cfg.moe_intermediate_size
    if name == "qwen2_moe":
        sizes[".expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    out = {arch + key: (value, U32) for key, value in sizes.items()}
    for field_name, field in reader.fields.items():
        if field_name.startswith("llama.") and arch + field_name.removeprefix("llama") not in out:
            out[arch + field_name.removeprefix("llama")] = (field.contents(), field.types[0])
    out[arch + ".rope.freq_base"] = (float(cfg.rope_parameters["rope_theta"]), GGUFValueType.FLOAT32)
    out[arch + ".attention.layer_norm_rms_epsilon"] = (float(cfg.rms_norm_eps), GGUFValueType.FLOAT32)
    out["general.architecture"] = (arch, GGUFValueType.STRING)
    return out


def _hf_model(name: str):
    # (no sliding window: llama.cpp's files for these architectures have none)
    extra = {"sliding_window": None} if name == "mixtral" else {}
    return tiny_models.build(name, vocab_size=VOCAB, **extra)


def _write(tmp_path, name: str, reader, expert_type=T.F32):
    model = _hf_model(name)
    path = tmp_path / f"tiny-{name}.gguf"
    write_gguf(path, reader, _tensors(model, name, expert_type), _overrides(model, name, reader))
    return model, path


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_the_config_says_what_the_file_holds(tmp_path, q4_1_reader, name):
    model, path = _write(tmp_path, name, q4_1_reader)
    config = read_gguf(path).config
    assert config["architectures"] == [type(model).__name__]
    assert config["num_experts_per_tok"] == 2
    assert config.get("num_experts", config.get("num_local_experts")) == 8
    assert config["norm_topk_prob"] == {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True}[name]
    if name == "qwen3_moe":  # (layer 1 is dense: no router in the file)
        assert config["mlp_only_layers"] == [1] and config["moe_intermediate_size"] == 64
    if name == "qwen2_moe":
        assert config["shared_expert_intermediate_size"] == 128


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_a_float_file_serves_like_the_hugging_face_model(tmp_path, q4_1_reader, tokenizer, name):
    model, path = _write(tmp_path, name, q4_1_reader)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=256 * 1024**2))
    try:
        assert engine.model_cfg.is_moe
        ours = run_engine(engine, prompts, GREEDY)
    finally:
        del engine
        gc.collect()
    with torch.no_grad():
        reference = [hf_greedy(model, p, GREEDY.max_tokens, stop_at_eos=False) for p in prompts]
    assert ours == reference


@pytest.mark.slow
@pytest.mark.parametrize("expert_type", [T.Q8_0, T.Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantized_experts_serve_like_hf_on_their_dequantized_weights(tmp_path, q4_1_reader, tokenizer, expert_type):
    """Experts stored Q8_0 / Q4_0 load into the fused MoE's INT8 / INT4 layouts (losslessly: GGUF's blocks
    are copied) and give the tokens of Hugging Face's model holding the file's dequantized experts."""
    from gguf.quants import dequantize, quantize

    model, path = _write(tmp_path, "qwen3_moe", q4_1_reader, expert_type)
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=256 * 1024**2))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    try:
        w13, w2 = engine.runner.model.decoder_layers()[0].mlp.experts()
        assert (w13.bits, w2.bits) == ({T.Q8_0: 8, T.Q4_0: 4}[expert_type],) * 2
        ours = run_engine(engine, prompts, GREEDY)
    finally:
        del engine
        gc.collect()
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            for param in () if experts is None else (experts.gate_up_proj, experts.down_proj):
                array = param.detach().numpy()
                blocks = quantize(np.ascontiguousarray(array.reshape(-1, array.shape[-1])), expert_type)
                param.copy_(torch.from_numpy(dequantize(blocks, expert_type).reshape(array.shape)))
        reference = [hf_greedy(model, p, GREEDY.max_tokens, stop_at_eos=False) for p in prompts]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= len(prompts) - 1


def test_float16_experts_load_as_stored(tmp_path, q4_1_reader):
    """Each expert's rows of a stacked F16 tensor arrive under that expert's checkpoint name."""
    from pagoda.engine_core.loader import iterate_weights, resolve_model

    model, path = _write(tmp_path, "qwen3_moe", q4_1_reader, T.F16)
    weights = dict(iterate_weights(resolve_model(str(path))))
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    for expert in (0, 7):
        got = weights[f"model.layers.0.mlp.experts.{expert}.up_proj.weight"]
        assert got.dtype == torch.float16 and got.shape == (64, 128)
        assert torch.equal(got, gate_up[expert, 64:].half())


@pytest.mark.slow  # (three loads of the file's model, its 49,152-token vocabulary: 6 to 10 s each)
@pytest.mark.parametrize("expert_type", [T.Q8_0, T.Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantized_experts_split_over_the_ranks(tmp_path, q4_1_reader, expert_type):
    """Two tensor-parallel ranks of a layer of Q8_0 / Q4_0 experts (built as workers build them, without the
    all-reduce): each expert's blocks are read whole and repacked, then cut to the rank's rows (gate, up) or
    columns (down, whole 32-column blocks); the ranks' partial sums add up to the whole layer's. (Expert
    parallel reads whole experts: test_moe_quantized_checkpoints.py.)"""
    from pagoda.engine_core.loader import load_model, resolve_model
    from pagoda.engine_core.model_config import ModelConfig
    from pagoda.engine_core.parallel.distributed import SINGLE, TPGroup
    from pagoda.engine_core.quantization import resolve_method

    _, path = _write(tmp_path, "qwen3_moe", q4_1_reader, expert_type)
    model_dir = resolve_model(str(path))
    cfg = ModelConfig.from_dir(model_dir)

    def layer(group=SINGLE):
        method = resolve_method("auto", cfg.raw)
        model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), quantization=method, group=group)
        return model.decoder_layers()[0].mlp

    whole, ranks = layer(), [layer(TPGroup(rank, 2)) for rank in range(2)]
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, parts = whole(x), [mlp(x) for mlp in ranks]
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-5, rtol=1e-4)
