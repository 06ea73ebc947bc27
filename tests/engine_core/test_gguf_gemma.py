"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's "gemma2" / "gemma3", engine_core/gguf_gemma.py): written with the
`gguf` package, in the names, metadata and norm convention (1 + w stored) of llama.cpp's converter, from the tiny
random Gemma models of tests/tiny_models.py (their 8-token window, soft-capping and Gemma 3's two rotary tables)
with a small byte-level tokenizer of their 512 tokens, then served directly. The float32 file gives Hugging
Face's greedy tokens on the checkpoint it was written from, past the window; a Q8_0 / Q4_0 file gives our own
float32 run of its dequantized weights; transformers' own reader of the file (which takes Gemma's defaults for
what the metadata does not say) agrees with us on a model whose config is those defaults.

The tiny models' query_pre_attn_scalar is set to their head_dim here: a GGUF file cannot carry another one
(llama.cpp scales by head_dim ** -0.5 but for the 27B models)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.gguf_gemma import NORMS_INCLUDE_ONE, config_fields, end_token_ids
from pagoda.engine_core.loader import load_model, resolve_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.tokenizer import load_tokenizer
from tests import tiny_models
from tests.engine_core.gguf_files import float32_dir, tiny_tokenizer_metadata, write_gguf
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine

T = GGMLQuantizationType
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
VOCAB = 512  # (tiny_models': the file's tokenizer has as many tokens)
HEAD_DIM = 32  # (tiny_models' Gemma head_dim, and here their query_pre_attn_scalar too)
NEW_TOKENS = 16
LENGTHS = (1, 6, 17, 40)  # (one token, inside the 8-token window, well past it)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LOGPROB_ATOL = 1e-4  # (test_gemma.py's: float32, only the summation order differs)
FAMILIES = tiny_models.GEMMA
_BLOCK = {  # Hugging Face module inside layer N -> llama.cpp's tensor inside blk.N
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, HF model): the tiny model with an attention scale a file can carry."""
    return request.param, tiny_models.build(request.param, query_pre_attn_scalar=HEAD_DIM)


@pytest.fixture(scope="module")
def f32_file(family, tmp_path_factory) -> Path:
    """The family's float32 file (read once per module: a file's tokenizer is read into its model directory)."""
    name, hf_model = family
    return _write(tmp_path_factory.mktemp(name) / f"{name}.gguf", name, hf_model)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _type_of(name: str, matrices) -> GGMLQuantizationType:
    """Vectors F32 (as the converter keeps them); a matrix's type from `matrices`: one type, or a function of
    the tensor's name."""
    return matrices(name) if callable(matrices) else matrices


def _tensors(model, matrices=T.F32) -> list:
    """The model's weights as llama.cpp's converter writes them: its names, every norm as 1 + w (added in
    float32, as the converter adds it to a float32 checkpoint), no output.weight (tied)."""
    out = []
    for key, value in model.state_dict().items():
        array = value.detach().float().numpy()
        if key.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            continue  # (tied: the converter skips it)
        else:
            layer, _, module = key.removeprefix("model.layers.").removesuffix(".weight").partition(".")
            name = f"blk.{layer}.{_BLOCK[module]}.weight"
        ggml_type = T.F32 if array.ndim == 1 else _type_of(name, matrices)
        out.append((name, np.ascontiguousarray(array), ggml_type))
    return out


def _metadata(model, arch: str, pattern: int | None) -> dict:
    """The keys the converter writes from the model's config; `pattern`: an attention.sliding_window_pattern
    (the converter writes none for Gemma: llama.cpp's default periods then hold)."""
    cfg = model.config
    keys = {
        "context_length": (cfg.max_position_embeddings, U32),
        "embedding_length": (cfg.hidden_size, U32),
        "block_count": (cfg.num_hidden_layers, U32),
        "feed_forward_length": (cfg.intermediate_size, U32),
        "attention.head_count": (cfg.num_attention_heads, U32),
        "attention.head_count_kv": (cfg.num_key_value_heads, U32),
        "attention.key_length": (cfg.head_dim, U32),
        "attention.value_length": (cfg.head_dim, U32),
        "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, F32),
        "attention.sliding_window": (cfg.sliding_window, U32),
    }
    if arch == "gemma2":
        keys["attn_logit_softcapping"] = (cfg.attn_logit_softcapping, F32)
        keys["final_logit_softcapping"] = (cfg.final_logit_softcapping, F32)
        keys["rope.freq_base"] = (cfg.rope_parameters["rope_theta"], F32)
    else:
        full, sliding = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        keys["rope.freq_base"] = (full["rope_theta"], F32)
        keys["rope.freq_base_swa"] = (sliding["rope_theta"], F32)
        if full.get("rope_type") == "linear":
            keys["rope.scaling.type"] = ("linear", GGUFValueType.STRING)
            keys["rope.scaling.factor"] = (full["factor"], F32)
    if pattern is not None:
        keys["attention.sliding_window_pattern"] = (pattern, U32)
    out = {f"{arch}.{key}": value for key, value in keys.items()}
    out["general.architecture"] = (arch, GGUFValueType.STRING)
    return out | tiny_tokenizer_metadata()


# tiny_models' Gemma 3 slides on layers 0, 1 and 3: a period of 3 (Gemma 2 alternates: llama.cpp's default)
_PATTERN = {"gemma2": None, "gemma3": 3}


def _write(path: Path, name: str, model, matrices=T.F32, pattern: int | None = -1) -> Path:
    pattern = _PATTERN[name] if pattern == -1 else pattern
    write_gguf(path, None, _tensors(model, matrices), _metadata(model, name, pattern))
    return path


def test_the_config_is_hfs(f32_file, family):
    """config.json says what HF's config says (the attention scale a file can carry, llama.cpp's for the rest);
    the model's layers follow it. (The tokenizer is transformers' reading of the file, as for every GGUF: for a
    Gemma file its Gemma sentencepiece builder, which SmolLM2's byte-level vocabulary does not fit, so these
    tests compare token ids only.)"""
    name, hf_model = family
    cfg = ModelConfig.from_dir(resolve_model(str(f32_file)))
    theirs = hf_model.config
    assert cfg.architecture == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[name]
    assert cfg.layer_types == tuple(theirs.layer_types) and cfg.sliding_window == 8
    assert cfg.tie_word_embeddings and cfg.head_dim == HEAD_DIM and cfg.raw[NORMS_INCLUDE_ONE]
    assert cfg.raw["query_pre_attn_scalar"] == HEAD_DIM and cfg.raw["hidden_activation"] == "gelu_pytorch_tanh"
    assert cfg.raw["final_logit_softcapping"] == theirs.final_logit_softcapping
    assert cfg.raw.get("attn_logit_softcapping") == theirs.attn_logit_softcapping
    if name == "gemma3":  # (full layers: base 1e6 scaled linearly by 4; sliding: base 10,000 unscaled)
        assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
        assert cfg.raw["rope_local_base_freq"] == 10000.0
    with torch.device("meta"):
        from pagoda.engine_core.models import model_class

        model = model_class(cfg.architecture)(cfg, torch.float32)
    assert all(a.scale == HEAD_DIM**-0.5 for a in model.attention_layers())
    assert [a.softcap for a in model.attention_layers()] == [3.0 if name == "gemma2" else 0.0] * 4


def test_the_norms_load_as_stored(f32_file, family):
    """The file's 1 + w is what our model multiplies by, bit for bit: HF's 1 + w in float32 (no second one)."""
    name, hf_model = family
    model_dir = resolve_model(str(f32_file))
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"))
    ours = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    theirs = {n.removeprefix("model."): p for n, p in hf_model.named_parameters() if n.endswith("norm.weight")}
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 4 + 1 + (8 if name == "gemma3" else 0)
    for key, weight in theirs.items():
        assert torch.equal(ours[key], 1.0 + weight.float()), key
    assert any((w < -0.5).any() for w in theirs.values())  # (where subtracting 1 and adding it back would round)


def test_a_float32_file_serves_like_hf(f32_file, family):
    """Greedy tokens HF's on the checkpoint the file was written from; first-step logprobs HF's (they see the
    final soft-capping)."""
    _, hf_model = family
    prompts = _prompts()
    ours, firsts = greedy_with_first_logprobs(f32_file, prompts, new_tokens=NEW_TOKENS, top=10, num_kv_blocks=64)
    assert ours == [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    with torch.no_grad():
        for prompt, first in zip(prompts, firsts, strict=True):
            theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
            ids = list(first)
            torch.testing.assert_close(torch.tensor([first[i] for i in ids]), theirs[ids], atol=LOGPROB_ATOL, rtol=0)


def _q8_attention_q4_mlp(name: str) -> GGMLQuantizationType:
    return T.Q4_0 if ".ffn_" in name else T.Q8_0  # (the tied embedding, the LM head's weight too: Q8_0)


def test_a_quantized_file_serves_like_its_float32_dequantization(tmp_path, family):
    """Q8_0 attention and embedding, Q4_0 MLP, loaded into the GGUF quantization method: the tokens of our float32
    run of the file's dequantized weights (test_gguf.py's comparison)."""
    name, hf_model = family
    path = _write(tmp_path / f"{name}-q8_0-q4_0.gguf", name, hf_model, matrices=_q8_attention_q4_mlp)
    engine = EngineCore(EngineConfig(model=str(path), num_kv_blocks=64))
    assert engine.model_cfg.raw["quantization_config"]["tensor_types"] == {"Q4_0": 12, "Q8_0": 17}
    model = engine.runner.model
    layer = model.decoder_layers()[0]
    assert layer.self_attn.qkv_proj.quantized.bits == 8 and layer.mlp.gate_up_proj.quantized.bits == 4
    assert model.lm_head.quantized.bits == 8  # (the tied embedding: the LM head's weight)
    prompts = _prompts()
    ours = run_engine(engine, prompts, GREEDY)
    del engine, model, layer
    gc.collect()
    reference, _ = greedy_with_first_logprobs(float32_dir(path), prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    assert ours == reference


# What transformers' GGUF reader takes from a Gemma file: sizes, rope_theta and the window. The rest is its
# configs' defaults: query_pre_attn_scalar 256 (so heads of 256), Gemma 2's soft-capping 50 / 30 and alternate
# layers, Gemma 3's five sliding layers to one full, its sliding base 10,000, no rope scaling or final capping.
_TRANSFORMERS_DEFAULTS = {
    "gemma2": dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(
        head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None, rope_parameters=None
    ),
}


@pytest.mark.slow  # (about 15 s each: transformers' GGUF loading, heads of 256)
@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_reads_the_file_as_we_do(tmp_path, name):
    """A model whose config is what transformers assumes, written without a pattern (llama.cpp's default periods):
    our tokens from the file are transformers' from the same file (it takes 1 off each norm and adds it back,
    which can round: all but one prompt alike, as test_gguf.py's Qwen comparison)."""
    from transformers import AutoModelForCausalLM

    hf_model = tiny_models.build(name, **_TRANSFORMERS_DEFAULTS[name])
    path = _write(tmp_path / f"{name}.gguf", name, hf_model, pattern=None)
    cfg = ModelConfig.from_dir(resolve_model(str(path)))
    assert cfg.layer_types == tuple(hf_model.config.layer_types)
    prompts = _prompts()
    ours, _ = greedy_with_first_logprobs(path, prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    theirs_model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    assert theirs_model.config.layer_types == hf_model.config.layer_types
    theirs = [hf_greedy(theirs_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= len(prompts) - 1


@pytest.mark.parametrize(
    ("arch", "meta", "expected"),
    [
        ("gemma2", {}, dict(sliding=[], softcaps=(50.0, 30.0), scalar=128)),  # (no window: all full)
        ("gemma2", {"attention.sliding_window": 4096}, dict(sliding=[0, 2, 4], softcaps=(50.0, 30.0), scalar=128)),
        ("gemma3", {"attention.sliding_window": 512}, dict(sliding=[0, 1, 2, 3, 4], softcaps=(None, None), scalar=128)),
        ("gemma3", {"attention.sliding_window": 512, "final_logit_softcapping": 30.0}, dict(softcaps=(None, 30.0))),
        ("gemma3", {"attention.sliding_window": 512, "attention.sliding_window_pattern": 2}, dict(sliding=[0, 2, 4])),
    ],
)
def test_llama_cpps_defaults_fill_what_a_file_leaves_out(arch, meta, expected):
    """Six layers of 8 heads of 128 over a hidden size of 2048: sliding layers (Gemma 2: every other one; Gemma
    3: five of six), soft-capping (Gemma 2's 50 / 30), the attention scale (head_dim ** -0.5)."""
    meta = {"general.architecture": arch, **{f"{arch}.{key}": value for key, value in meta.items()}}
    config = {"num_hidden_layers": 6, "hidden_size": 2048, "num_attention_heads": 8, "head_dim": 128}
    fields = config_fields(Path("x.gguf"), meta, {**config, "rope_theta": 1e6})
    if "sliding" in expected:
        assert [i for i, k in enumerate(fields["layer_types"]) if k == "sliding_attention"] == expected["sliding"]
    if "softcaps" in expected:
        assert (fields.get("attn_logit_softcapping"), fields["final_logit_softcapping"]) == expected["softcaps"]
    if "scalar" in expected:
        assert fields["query_pre_attn_scalar"] == expected["scalar"]


@pytest.mark.parametrize(("arch", "layers", "scalar"), [("gemma2", 46, 144), ("gemma3", 62, 168), ("gemma3", 48, 256)])
def test_the_27b_models_scale_attention_by_hidden_over_heads(arch, layers, scalar):
    """llama.cpp's rule (Google's configs): Gemma 2 27B (4608 / 32 heads) 144, Gemma 3 27B (5376 / 32) 168; the
    others by their heads' width (256)."""
    hidden = {"gemma2": 4608, "gemma3": 5376}[arch] if layers in (46, 62) else 3840
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": 32, "head_dim": 256}
    meta = {"general.architecture": arch, f"{arch}.attention.sliding_window": 4096}
    assert config_fields(Path("x.gguf"), meta, {**config, "rope_theta": 1e6})["query_pre_attn_scalar"] == scalar


def _sentencepiece_metadata() -> dict:
    """A Gemma-like sentencepiece vocabulary (`llama` model, as Gemma's files hold theirs) of VOCAB tokens: its
    control tokens first, a few pieces, then unused ones (user-defined, as in Gemma's)."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581", "h", "e", "l", "o"]
    pieces += ["w", "r", "d", "\u2581h", "he", "ll", "\u2581he", "llo", "\u2581hello", "\u2581w", "or", "\u2581wor"]
    pieces += ["ld", "\u2581world"]
    tokens = pieces + [f"<unused{i}>" for i in range(VOCAB - len(pieces))]
    types = [3, 3, 3, 2, 3, 3] + [1] * (len(pieces) - 6) + [4] * (VOCAB - len(pieces))  # (control, unknown, ...)
    u32, array = GGUFValueType.UINT32, GGUFValueType.ARRAY
    return {
        "tokenizer.ggml.model": ("llama", GGUFValueType.STRING),
        "tokenizer.ggml.tokens": (tokens, array),
        "tokenizer.ggml.scores": ([0.0] * VOCAB, array),
        "tokenizer.ggml.token_type": (types, array),
        "tokenizer.ggml.bos_token_id": (2, u32),
        "tokenizer.ggml.eos_token_id": (1, u32),
        "tokenizer.ggml.unknown_token_id": (3, u32),
        "tokenizer.ggml.padding_token_id": (0, u32),
        "tokenizer.ggml.add_bos_token": (True, GGUFValueType.BOOL),
        "tokenizer.ggml.add_space_prefix": (False, GGUFValueType.BOOL),
    }


def test_a_sentencepiece_vocabulary_reads_as_gemmas(tmp_path, family):
    """A Gemma file's own kind of tokenizer: transformers' Gemma reading of it (BOS first, no space prefix,
    control tokens whole); generation ends on <eos> and <end_of_turn>."""
    name, hf_model = family
    meta = {k: v for k, v in _metadata(hf_model, name, _PATTERN[name]).items() if not k.startswith("tokenizer.")}
    path = tmp_path / f"{name}-spm.gguf"
    write_gguf(path, None, _tensors(hf_model), meta | _sentencepiece_metadata())
    cfg = ModelConfig.from_dir(resolve_model(str(path)))
    assert cfg.eos_token_ids == {1, 5}
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("hello world") == [2, 15, 18, 24]  # (<bos> he llo \u2581world)
    assert tokenizer.encode("<start_of_turn>hello<end_of_turn>") == [2, 4, 15, 18, 5]


def test_generation_ends_on_gemmas_end_of_turn():
    """The file's eos, its eot, then <end_of_turn> where the vocabulary has it (each once)."""
    vocabulary = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    assert end_token_ids(vocabulary, 1, None) == [1, 4]
    assert end_token_ids(vocabulary, 1, 4) == [1, 4]
    assert end_token_ids(["a", "b"], 1, None) == [1]
