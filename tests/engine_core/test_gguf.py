"""GGUF files served directly: the model directory made from a file's metadata, its quantized weights
loaded into the quantization seat, greedy tokens against Pagoda serving the same weights dequantized
to float32, and the errors for files that cannot be served."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.environment import cache_root
from pagoda.engine_core.gguf_model import MARKER, model_source, read_gguf
from pagoda.engine_core.loader import iterate_weights, resolve_model
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.tokenizer import load_tokenizer
from tests.engine_core.gguf_files import TEST_MODELS, float32_dir, smollm2_as, write_gguf
from tests.helpers import golden_prompts, hf_greedy, run_engine

T = GGMLQuantizationType
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KV = 256 * 1024**2
TEXTS = ["Hello world", " The capital of France is", "déjà vu 🤖 naïve", "<|im_start|>user\nhi<|im_end|>\n", "x = 1"]


@pytest.fixture(scope="module")
def q4_1_file():
    return ensure_default_gguf()


@pytest.fixture(scope="module")
def q4_1_dir(q4_1_file):
    return resolve_model(str(q4_1_file))


def test_the_model_directory_comes_from_the_files_metadata(q4_1_file, q4_1_dir, default_model_dir, tokenizer):
    config = json.loads((q4_1_dir / "config.json").read_text())
    declared = config.pop("quantization_config")
    assert declared == {"quant_method": "gguf", "tensor_types": {"Q4_1": 210, "Q8_0": 1}}
    assert config == json.loads((default_model_dir / "config.json").read_text())
    for name in ("generation_config.json", "chat_template.jinja"):
        assert (q4_1_dir / name).read_text() == (default_model_dir / name).read_text()
    assert not list(q4_1_dir.glob("*.safetensors"))  # the weights stay in the .gguf
    assert resolve_model(str(q4_1_file)) == q4_1_dir  # made once
    assert model_source(q4_1_dir) == str(q4_1_file) and model_source(default_model_dir) == str(default_model_dir)
    gguf_tokenizer = load_tokenizer(q4_1_file)  # a .gguf path works wherever a tokenizer is loaded
    assert [gguf_tokenizer.encode(t) for t in TEXTS] == [tokenizer.encode(t) for t in TEXTS]
    assert gguf_tokenizer.chat_template == tokenizer.chat_template


def test_quantized_weights_arrive_raw_and_float_ones_as_floats(q4_1_dir):
    names = {}
    for name, tensor in iterate_weights(q4_1_dir):
        names[name] = tensor
        if len(names) == 12:
            break
    assert names["model.embed_tokens.gguf_type"].item() == int(T.Q8_0)  # tied: the LM head's weight
    assert tuple(names["model.embed_tokens.gguf_blocks"].shape) == (49152, 576 // 32 * 34)
    assert names["model.layers.0.input_layernorm.weight"].dtype.is_floating_point
    assert tuple(names["model.layers.0.self_attn.k_proj.gguf_blocks"].shape) == (192, 576 // 32 * 20)


# --- files that cannot be served: one clear error, before anything runs --------------------------


@pytest.fixture(scope="module")
def q4_1_reader(q4_1_file):
    return GGUFReader(str(q4_1_file))  # (reading its vocabulary takes seconds: once per module)


def _small_file(path, reader, tensors, overrides=None):
    """A GGUF with the Q4_1 file's metadata (tokenizer included) and the given tensors."""
    write_gguf(path, reader, tensors, overrides)
    return path


def test_a_truncated_or_corrupt_file_is_refused(tmp_path, q4_1_file):
    data = q4_1_file.read_bytes()
    for name, content in [("cut-in-weights", data[:50_000_000]), ("cut-in-header", data[:1_000_000])]:
        (tmp_path / f"{name}.gguf").write_bytes(content)
        with pytest.raises(ValueError, match=r"is not a readable GGUF file \(truncated or corrupt\?\)"):
            resolve_model(str(tmp_path / f"{name}.gguf"))
    (tmp_path / "bad-magic.gguf").write_bytes(b"GGML" + data[4:1000])
    with pytest.raises(ValueError, match=r"not a readable GGUF file.*magic"):
        resolve_model(str(tmp_path / "bad-magic.gguf"))


def test_an_unsupported_tensor_type_is_refused_naming_the_supported_ones(tmp_path, q4_1_reader):
    blocks = np.random.default_rng(0).integers(0, 256, (16, 84), dtype=np.uint8)  # 16 rows of 256 columns
    path = _small_file(tmp_path / "q2_k.gguf", q4_1_reader, [("blk.0.attn_q.weight", blocks, T.Q2_K)])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "blk.0.attn_q.weight has GGML type Q2_K, which Pagoda does not load; "
            "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
        ),
    ):
        resolve_model(str(path))


def test_an_unsupported_architecture_is_refused(tmp_path, q4_1_reader):
    overrides = {"general.architecture": ("falcon", GGUFValueType.STRING)}
    path = _small_file(tmp_path / "falcon.gguf", q4_1_reader, [("output_norm.weight", np.ones(576), T.F32)], overrides)
    supported = "gemma2, gemma3, gpt-oss, llama, phi3, qwen2, qwen2moe, qwen3, qwen35, qwen35moe, qwen3moe"
    with pytest.raises(ValueError, match=f"GGUF architecture 'falcon' is not supported; supported: {supported}"):
        resolve_model(str(path))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("int4", "already quantized with 'gguf'; --quantization int4 cannot quantize it again"),
        ("int8", "already quantized with 'gguf'; --quantization int8 cannot quantize it again"),
        ("none", "quantized with 'gguf': --quantization none cannot load it"),
    ],
)
def test_quantization_flags_that_contradict_the_file_are_refused(q4_1_file, flag, message):
    with pytest.raises(ValueError, match=message):
        EngineCore(EngineConfig(model=str(q4_1_file), quantization=flag, kv_cache_memory=KV))


# --- a tiny untied model: every supported type the gguf package writes, floats among them ---------

TINY = {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 49152}


def _tiny_tensors(seed: int = 0):
    rng = np.random.default_rng(seed)
    h, f, v = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    kv = h // TINY["heads"] * TINY["kv_heads"]

    def w(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32) * cols**-0.5

    tensors = [("token_embd.weight", w(v, h) * 8, T.Q8_0), ("output_norm.weight", 1 + 0.1 * w(1, h)[0], T.F32)]
    layer_types = [  # q, k, v, o, gate, up, down: a merged QKV of 4- and 8-bit shards, float o_proj
        (T.Q4_1, T.Q4_1, T.Q8_0, T.F16, T.Q5_0, T.Q5_1, T.Q8_0),
        (T.Q8_0, T.Q8_0, T.Q8_0, T.BF16, T.Q4_0, T.Q4_0, T.Q4_1),
    ]
    for i, (q, k, vt, o, gate, up, down) in enumerate(layer_types):
        tensors += [
            (f"blk.{i}.attn_norm.weight", 1 + 0.1 * w(1, h)[0], T.F32),
            (f"blk.{i}.attn_q.weight", w(h, h), q),
            (f"blk.{i}.attn_k.weight", w(kv, h), k),
            (f"blk.{i}.attn_v.weight", w(kv, h), vt),
            (f"blk.{i}.attn_output.weight", w(h, h), o),
            (f"blk.{i}.ffn_norm.weight", 1 + 0.1 * w(1, h)[0], T.F32),
            (f"blk.{i}.ffn_gate.weight", w(f, h), gate),
            (f"blk.{i}.ffn_up.weight", w(f, h), up),
            (f"blk.{i}.ffn_down.weight", w(h, f), down),
        ]
    tensors.append(("output.weight", w(v, h), T.Q4_0))  # untied: the embedding table is its own tensor
    return tensors


def _tiny_overrides():
    u32 = GGUFValueType.UINT32
    return {
        "llama.embedding_length": (TINY["hidden"], u32),
        "llama.feed_forward_length": (TINY["ffn"], u32),
        "llama.block_count": (TINY["layers"], u32),
        "llama.attention.head_count": (TINY["heads"], u32),
        "llama.attention.head_count_kv": (TINY["kv_heads"], u32),
        "llama.rope.dimension_count": (TINY["hidden"] // TINY["heads"], u32),
        "llama.context_length": (512, u32),
    }


@pytest.fixture(scope="module")
def tiny_file(q4_1_reader):
    target = cache_root() / TEST_MODELS / "tiny-llama-untied-mixed.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(".staging")
        _small_file(staging, q4_1_reader, _tiny_tensors(), _tiny_overrides())
        staging.rename(target)
    return target


def _greedy(model: str, prompts, **config) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model=model, kv_cache_memory=KV, **config))
    try:
        return run_engine(engine, prompts, GREEDY_32)
    finally:
        del engine
        gc.collect()


def test_a_tiny_untied_model_of_mixed_types_equals_its_float32_weights(tiny_file, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    engine = EngineCore(EngineConfig(model=str(tiny_file), kv_cache_memory=KV))
    model = engine.runner.model
    assert model.embed_tokens is not None and model.lm_head.quantized is not None  # dequantized table
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.quantized.bits == 8 and attn.o_proj.quantized is None  # widened; F16 stays float
    assert model.layers[1].mlp.gate_up_proj.quantized.bits == 4
    ours = run_engine(engine, prompts, GREEDY_32)
    del engine
    reference = _greedy(str(float32_dir(tiny_file)), prompts)
    assert ours == reference


def test_a_file_changed_since_it_was_opened_is_refused(tmp_path, tiny_file, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))  # (the copy's directory goes away with it)
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_file, copy)
    model_dir = resolve_model(str(copy))
    assert (model_dir / MARKER).exists() and str(model_dir).startswith(str(tmp_path))
    os.utime(copy, ns=(0, 0))
    with pytest.raises(ValueError, match="changed since it was opened"):
        next(iterate_weights(model_dir))
    copy.unlink()
    with pytest.raises(FileNotFoundError, match="is gone"):
        next(iterate_weights(model_dir))


# --- SmolLM2: the Q4_1 file itself, and the same weights written as other types ----------------


def _compare(gguf_path, float_dir, tokenizer) -> int:
    prompts = golden_prompts(tokenizer)
    ours = _greedy(str(gguf_path), prompts)
    reference = _greedy(str(float_dir), prompts)
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    print(f"{gguf_path.name}: {same} of {len(prompts)} prompts give the same 32 greedy tokens")
    return same


@pytest.mark.slow
def test_the_q4_1_file_serves_like_its_float32_directory(q4_1_file, default_model_dir, tokenizer):
    # The default model directory is this file dequantized: only the summation order differs.
    assert _compare(q4_1_file, default_model_dir, tokenizer) >= 9


@pytest.mark.slow
def test_a_q8_0_file_serves_like_its_float32_dequantization(tokenizer):
    path = smollm2_as("Q8_0", lambda name: T.Q8_0)
    assert _compare(path, float32_dir(path), tokenizer) >= 9


def _mixed(name: str) -> GGMLQuantizationType:
    kinds = {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q5_1}
    kinds |= {"ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q4_1, "token_embd": T.Q8_0}
    return kinds[name.split(".")[-2]]


@pytest.mark.slow
def test_a_file_of_mixed_types_serves_like_its_float32_dequantization(tokenizer):
    path = smollm2_as("mixed-Q4_0-Q5_0-Q5_1-Q8_0", _mixed)
    assert _compare(path, float32_dir(path), tokenizer) >= 9


# --- Qwen2 (q/k/v biases) and Qwen3 (q/k norms): no rotary permutation, against transformers' GGUF loader --


# Heads of 64: transformers' GGUF reader takes Qwen's head_dim as 64, whatever the file says.
QWEN = {"hidden": 256, "ffn": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 49152}


def _qwen_tensors(arch: str, seed: int = 0):
    """A tiny untied Qwen2 / Qwen3 in Q8_0 and F32 (exact in both readers)."""
    rng = np.random.default_rng(seed)
    h, f, v, hd = QWEN["hidden"], QWEN["ffn"], QWEN["vocab"], QWEN["hidden"] // QWEN["heads"]
    q, kv = QWEN["heads"] * hd, QWEN["kv_heads"] * hd

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * shape[-1] ** -0.5

    tensors = [("token_embd.weight", w(v, h) * 8, T.Q8_0), ("output_norm.weight", 1 + 0.1 * w(h), T.F32)]
    for i in range(QWEN["layers"]):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", 1 + 0.1 * w(h), T.F32),
            (b + "attn_q.weight", w(q, h), T.Q8_0),
            (b + "attn_k.weight", w(kv, h), T.Q8_0),
            (b + "attn_v.weight", w(kv, h), T.Q8_0),
            (b + "attn_output.weight", w(h, q), T.Q8_0),
            (b + "ffn_norm.weight", 1 + 0.1 * w(h), T.F32),
            (b + "ffn_gate.weight", w(f, h), T.Q8_0),
            (b + "ffn_up.weight", w(f, h), T.Q8_0),
            (b + "ffn_down.weight", w(h, f), T.Q8_0),
        ]
        if arch == "qwen2":
            tensors += [(b + f"attn_{x}.bias", w(n) * 4, T.F32) for x, n in (("q", q), ("k", kv), ("v", kv))]
        else:
            tensors += [(b + f"attn_{x}_norm.weight", 1 + 0.3 * w(hd), T.F32) for x in ("q", "k")]
    return [*tensors, ("output.weight", w(v, h), T.Q8_0)]


def _qwen_overrides(arch: str, reader, key_length: int) -> dict:
    """The source's `llama.*` keys under `arch`'s prefix, with the tiny model's sizes."""
    u32 = GGUFValueType.UINT32
    sizes = {
        ".embedding_length": QWEN["hidden"],
        ".feed_forward_length": QWEN["ffn"],
        ".block_count": QWEN["layers"],
        ".attention.head_count": QWEN["heads"],
        ".attention.head_count_kv": QWEN["kv_heads"],
        ".rope.dimension_count": QWEN["hidden"] // QWEN["heads"],
        ".context_length": 512,
        ".attention.key_length": key_length,
    }
    out = {arch + key: (value, u32) for key, value in sizes.items()}
    for name, field in reader.fields.items():
        if name.startswith("llama.") and arch + name.removeprefix("llama") not in out:
            out[arch + name.removeprefix("llama")] = (field.contents(), field.types[0])
    out["general.architecture"] = (arch, GGUFValueType.STRING)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_qwen_file_serves_like_transformers_reading_it(arch, tmp_path, q4_1_reader, tokenizer):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}.gguf"
    hd = QWEN["hidden"] // QWEN["heads"]
    _small_file(path, q4_1_reader, _qwen_tensors(arch), _qwen_overrides(arch, q4_1_reader, hd))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=KV))
    model = engine.runner.model
    assert engine.model_cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    attn = model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2") and (attn.q_norm is not None) == (arch == "qwen3")
    ours = run_engine(engine, prompts, GREEDY_32)
    del engine
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    reference = [hf_greedy(hf, p, 32, stop_at_eos=False) for p in prompts]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= len(prompts) - 1


def test_qwen3_head_width_comes_from_key_length(tmp_path, q4_1_reader):
    """Qwen3's heads can be wider than hidden / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128)."""
    path = tmp_path / "wide-heads.gguf"
    _small_file(
        path,
        q4_1_reader,
        [("output_norm.weight", np.ones(64, np.float32), T.F32)],
        _qwen_overrides("qwen3", q4_1_reader, 128),
    )
    config = read_gguf(path).config
    assert (config["head_dim"], config["hidden_size"], config["num_attention_heads"]) == (128, 256, 4)
