"""gpt-oss GGUF files (llama.cpp's "gpt-oss", engine_core/gguf_gpt_oss.py): written with the `gguf` package, in
the names and layout of llama.cpp's converter, from the tiny random gpt-oss of tests/tiny_models.py (its
8-token sliding window, YaRN, sinks and biases) with the default model's tokenizer metadata, then served
directly. Float experts, and MXFP4 experts (quantized by the gguf package) beside Q8_0 attention and
embeddings as llama.cpp's MXFP4_MOE files hold them, give Hugging Face's greedy tokens on the weights the file
holds, past the window; the MXFP4 repack is lossless against the gguf package's dequantization; float and
other quantized experts, and gate and up joined, load; experts mixing MXFP4 with another type are refused."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import MXFP4, dequantize, quantize

from pagoda.engine_core.default_model import ensure_default_gguf
from pagoda.engine_core.gguf_gpt_oss import config_fields, end_token_ids
from pagoda.engine_core.gguf_model import read_gguf
from pagoda.engine_core.gguf_weights import mxfp4_from_ggml
from pagoda.engine_core.loader import iterate_weights, load_model, resolve_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.tokenizer import load_tokenizer
from pagoda.kernels import mxfp4
from pagoda.kernels.mxfp4 import Mxfp4Experts
from tests import tiny_models
from tests.engine_core.gguf_files import write_gguf
from tests.helpers import greedy_with_first_logprobs, hf_greedy
from tests.parallel_checks import compare_runs, random_prompts

T = GGMLQuantizationType
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
VOCAB = 49152  # SmolLM2's: the file carries its tokenizer
NEW_TOKENS = 16
LENGTHS = (6, 17, 40)  # inside the 8-token window, and well past it
# First-step logprobs against HF's eager float32 run (test_gpt_oss.py's bound: the same model and kernels).
LOGPROB_ATOL = 1e-4
_BLOCK = {  # Hugging Face module inside layer N -> llama.cpp's tensor inside blk.N
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}


@pytest.fixture(scope="module")
def q4_1_reader():
    return GGUFReader(str(ensure_default_gguf()))  # (its metadata: SmolLM2's tokenizer and chat template)


def _hf_model():
    return tiny_models.build("gpt_oss", vocab_size=VOCAB)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _experts(layer) -> dict[str, np.ndarray]:
    """A layer's experts as llama.cpp's converter writes them: each projection rows first ([E, out, in]),
    HF's interleaved gate_up rows split into gate (even) and up (odd)."""
    experts = layer.mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2).numpy()  # [E, in, out] -> [E, 2I, H]
    bias = experts.gate_up_proj_bias.detach().numpy()
    return {
        "ffn_gate_exps.weight": gate_up[:, 0::2],
        "ffn_up_exps.weight": gate_up[:, 1::2],
        "ffn_down_exps.weight": experts.down_proj.detach().transpose(1, 2).numpy(),
        "ffn_gate_exps.bias": bias[:, 0::2],
        "ffn_up_exps.bias": bias[:, 1::2],
        "ffn_down_exps.bias": experts.down_proj_bias.detach().numpy(),
    }


def _tensors(model, expert_type=T.F32, other_type=T.F32, fused: bool = False, overrides: dict | None = None) -> list:
    """The model's weights under llama.cpp's names: expert weights as `expert_type`, the other matrices as
    `other_type`, vectors F32. `fused`: gate and up joined (ffn_gate_up_exps, gate rows first). `overrides`:
    a tensor name -> its type."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    named = {
        "token_embd.weight": state.pop("model.embed_tokens.weight"),
        "output_norm.weight": state.pop("model.norm.weight"),
        "output.weight": state.pop("lm_head.weight"),
    }
    for i, layer in enumerate(model.model.layers):
        blk, prefix = f"blk.{i}.", f"model.layers.{i}."
        named[blk + "attn_sinks.weight"] = state[prefix + "self_attn.sinks"]
        for module, gguf in _BLOCK.items():
            for kind in ("weight", "bias"):
                if f"{prefix}{module}.{kind}" in state:
                    named[f"{blk}{gguf}.{kind}"] = state[f"{prefix}{module}.{kind}"]
        experts = _experts(layer)
        if fused:
            for kind in ("weight", "bias"):
                gate, up = experts.pop(f"ffn_gate_exps.{kind}"), experts.pop(f"ffn_up_exps.{kind}")
                experts[f"ffn_gate_up_exps.{kind}"] = np.concatenate((gate, up), axis=1)
        named.update({blk + name: value for name, value in experts.items()})
    out = []
    for name, value in named.items():
        if value.ndim == 1 or name.endswith(".bias"):
            ggml_type = T.F32
        else:
            ggml_type = expert_type if "_exps." in name else other_type
        out.append((name, np.ascontiguousarray(value), (overrides or {}).get(name, ggml_type)))
    return out


def _metadata(model) -> dict:
    """gpt-oss's keys, as the converter writes them from the tiny model's config."""
    cfg = model.config
    rope = cfg.rope_parameters
    keys = {
        "context_length": (cfg.max_position_embeddings, U32),
        "embedding_length": (cfg.hidden_size, U32),
        "feed_forward_length": (cfg.intermediate_size, U32),
        "expert_feed_forward_length": (cfg.intermediate_size, U32),
        "block_count": (cfg.num_hidden_layers, U32),
        "attention.head_count": (cfg.num_attention_heads, U32),
        "attention.head_count_kv": (cfg.num_key_value_heads, U32),
        "attention.key_length": (cfg.head_dim, U32),
        "attention.value_length": (cfg.head_dim, U32),
        "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, F32),
        "attention.sliding_window": (cfg.sliding_window, U32),
        "expert_count": (cfg.num_local_experts, U32),
        "expert_used_count": (cfg.num_experts_per_tok, U32),
        "rope.freq_base": (rope["rope_theta"], F32),
        "rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (rope["factor"], F32),
        "rope.scaling.original_context_length": (rope["original_max_position_embeddings"], U32),
        "rope.scaling.yarn_beta_fast": (rope["beta_fast"], F32),
        "rope.scaling.yarn_beta_slow": (rope["beta_slow"], F32),
    }
    out = {f"gpt-oss.{key}": value for key, value in keys.items()}
    out["general.architecture"] = ("gpt-oss", GGUFValueType.STRING)
    return out


def _write(path, reader, model, **tensor_args):
    write_gguf(path, reader, _tensors(model, **tensor_args), _metadata(model))
    return path


def _as_stored(array: np.ndarray, ggml_type) -> np.ndarray:
    """What a file holding `array` as `ggml_type` gives back: the gguf package's round trip."""
    if ggml_type == T.F32:
        return array
    return dequantize(quantize(np.ascontiguousarray(array, np.float32), ggml_type), ggml_type).reshape(array.shape)


def _load_file_weights_into(model, tensors: list) -> None:
    """Put into HF's model the weights a file written from `tensors` holds (rounded as stored), in HF's
    layout (gate and up interleaved again)."""
    stored = {name: torch.from_numpy(_as_stored(value, ggml_type)) for name, value, ggml_type in tensors}
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(stored["token_embd.weight"])
        model.lm_head.weight.copy_(stored["output.weight"])
        for i, layer in enumerate(model.model.layers):
            blk = f"blk.{i}."
            for module, gguf in _BLOCK.items():
                for kind in ("weight", "bias"):
                    if f"{blk}{gguf}.{kind}" in stored:
                        layer.get_submodule(module).get_parameter(kind).copy_(stored[f"{blk}{gguf}.{kind}"])
            experts = layer.mlp.experts
            for kind, param in (("weight", experts.gate_up_proj), ("bias", experts.gate_up_proj_bias)):
                gate, up = stored[f"{blk}ffn_gate_exps.{kind}"], stored[f"{blk}ffn_up_exps.{kind}"]
                if kind == "weight":
                    gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # -> [E, in, out]
                param[..., 0::2], param[..., 1::2] = gate, up
            experts.down_proj.copy_(stored[f"{blk}ffn_down_exps.weight"].transpose(1, 2))
            experts.down_proj_bias.copy_(stored[f"{blk}ffn_down_exps.bias"])


def _serve_and_compare(path, hf_model) -> None:
    """Greedy tokens and first-step logprobs from the file, served, against HF's on the same weights."""
    prompts = _prompts()
    ours, firsts = greedy_with_first_logprobs(path, prompts, new_tokens=NEW_TOKENS, top=10, num_kv_blocks=64)
    with torch.no_grad():
        assert ours == [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
        for prompt, first in zip(prompts, firsts, strict=True):
            theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
            ids = list(first)
            torch.testing.assert_close(torch.tensor([first[i] for i in ids]), theirs[ids], atol=LOGPROB_ATOL, rtol=0)


def test_the_config_is_hfs(tmp_path, q4_1_reader, tokenizer):
    """config.json says what HF's config says; the tokenizer is the file's (SmolLM2's, the same path as every
    GGUF's: transformers' reading of its metadata)."""
    hf_model = _hf_model()
    path = _write(tmp_path / "f32.gguf", q4_1_reader, hf_model)
    cfg = ModelConfig.from_dir(resolve_model(str(path)))
    theirs = hf_model.config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.raw["model_type"] == "gpt_oss"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, theirs.intermediate_size)
    assert cfg.layer_types == tuple(theirs.layer_types) and cfg.sliding_window == 8
    assert cfg.attention_bias and cfg.o_proj_bias and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == {k: v for k, v in theirs.rope_parameters.items() if k != "rope_theta"}
    assert (cfg.raw["swiglu_alpha"], cfg.raw["swiglu_limit"]) == (theirs.swiglu_alpha, theirs.swiglu_limit)
    assert "quantization_config" not in cfg.raw  # (float experts; the file's types all float)
    # Generation ends on the file's eos (SmolLM2's <|im_end|>, 2) and those of gpt-oss's end tokens the vocabulary
    # has (<|endoftext|>, 0: SmolLM2's has no <|return|> or <|call|>).
    assert cfg.eos_token_ids == {2, 0}
    texts = ["Hello world", "déjà vu 🤖", "<|im_start|>user\nhi<|im_end|>\n"]
    gguf_tokenizer = load_tokenizer(path)
    assert [gguf_tokenizer.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
    assert gguf_tokenizer.chat_template == tokenizer.chat_template


@pytest.mark.parametrize(
    ("pattern", "sliding"),
    [(None, [0, 2, 4]), (3, [0, 1, 3, 4]), (1, []), (0, [0, 1, 2, 3, 4, 5]), ([False, True] * 3, [1, 3, 5])],
)
def test_the_sliding_layers_are_llama_cpps(pattern, sliding):
    """No pattern: llama.cpp's default for gpt-oss, the even layers (HF's too); a period n: layer i slides when
    i % n < n - 1 (0: all); a list names them."""
    meta = {"gpt-oss.expert_count": 4, "gpt-oss.expert_used_count": 2, "gpt-oss.attention.sliding_window": 128}
    if pattern is not None:
        meta["gpt-oss.attention.sliding_window_pattern"] = pattern
    fields = config_fields(Path("x.gguf"), meta, {"num_hidden_layers": 6, "intermediate_size": 64, "rope_theta": 1e4})
    assert [i for i, kind in enumerate(fields["layer_types"]) if kind == "sliding_attention"] == sliding


def test_generation_ends_on_gpt_oss_end_tokens():
    """The file's eos, then <|return|>, <|endoftext|> and <|call|> where the vocabulary has them (the released
    generation_config.json's eos ids, o200k_harmony's 200002, 199999, 200012)."""
    vocabulary = ["<|endoftext|>", "a", "<|return|>", "b", "<|call|>"]
    assert end_token_ids(vocabulary, 2) == [2, 0, 4]
    assert end_token_ids(["a", "<|endoftext|>"], None) == [1]


def test_the_mxfp4_repack_is_lossless():
    """ggml's blocks (exponent bytes 0 to 250, random nibbles) repacked into HF's layout dequantize
    (kernels/mxfp4.py) to exactly the gguf package's dequantization of the ggml blocks."""
    gen = np.random.default_rng(0)
    blocks = gen.integers(0, 256, (251, 4, 17), dtype=np.uint8)
    blocks[:, :, 0] = np.arange(251, dtype=np.uint8)[:, None]
    hf_blocks, scales = mxfp4_from_ggml(torch.from_numpy(blocks))
    assert hf_blocks.shape == (251, 4, 16) and scales.shape == (251, 4)
    ours = mxfp4.dequantize(hf_blocks, scales, torch.float32).reshape(251, -1)
    theirs = torch.from_numpy(MXFP4.dequantize_blocks(blocks.reshape(-1, 17)).reshape(251, -1))
    assert torch.equal(ours, theirs)  # (-0 and 0 equal: the gguf package reads nibble 8 as 0, we as -0)
    assert not torch.equal(ours, theirs.reshape(251, 4, 2, 16).transpose(2, 3).reshape(251, -1))  # (the order)


def test_float_experts_serve_like_hf(tmp_path, q4_1_reader):
    hf_model = _hf_model()
    path = _write(tmp_path / "f32.gguf", q4_1_reader, hf_model)
    _serve_and_compare(path, hf_model)


def test_mxfp4_experts_stay_4_bit_and_serve_like_hf(tmp_path, q4_1_reader):
    """llama.cpp's MXFP4_MOE layout (experts MXFP4, other matrices Q8_0): the experts load as MXFP4 blocks whose
    dequantization is the gguf package's; HF's model holding the file's weights gives the same tokens."""
    hf_model = _hf_model()
    tensors = _tensors(hf_model, expert_type=T.MXFP4, other_type=T.Q8_0)
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, q4_1_reader, tensors, _metadata(hf_model))
    model_dir = resolve_model(str(path))
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.raw["quantization_config"] == {"quant_method": "mxfp4"}
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    stored = {name: _as_stored(value, ggml_type) for name, value, ggml_type in tensors}
    for i, layer in enumerate(model.decoder_layers()):
        mlp = layer.mlp
        assert isinstance(mlp.w13, Mxfp4Experts) and isinstance(mlp.w2, Mxfp4Experts)
        gate_up = np.concatenate((stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]), 1)
        assert torch.equal(mlp.w13.dequantized(), torch.from_numpy(gate_up))
        assert torch.equal(mlp.w2.dequantized(), torch.from_numpy(stored[f"blk.{i}.ffn_down_exps.weight"]))
    del model
    gc.collect()
    _load_file_weights_into(hf_model, tensors)
    _serve_and_compare(path, hf_model)


def test_gate_and_up_joined_load_as_apart(tmp_path, q4_1_reader):
    """A file with the converter's fused ffn_gate_up_exps (gate rows, then up rows) loads the same experts."""
    hf_model = _hf_model()
    experts = {}
    for fused in (False, True):
        path = _write(tmp_path / f"fused-{fused}.gguf", q4_1_reader, hf_model, expert_type=T.MXFP4, fused=fused)
        model_dir = resolve_model(str(path))
        model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"))
        mlp = model.decoder_layers()[1].mlp
        experts[fused] = [t.clone() for t in (mlp.w13.blocks, mlp.w13.scales, mlp.w13_bias, mlp.w2.blocks)]
    assert all(torch.equal(a, b) for a, b in zip(experts[False], experts[True], strict=True))


@pytest.mark.parametrize("expert_type", [T.F16, T.BF16, T.Q8_0], ids=["F16", "BF16", "Q8_0"])
def test_other_expert_types_load_at_full_precision(tmp_path, q4_1_reader, expert_type):
    """F16 / BF16 experts arrive as stored; Q8_0 ones dequantized to float32 (the model holds no Q8_0 experts).
    Each arrives whole, rows first, under its stacked-projection name."""
    hf_model = _hf_model()
    path = _write(tmp_path / "experts.gguf", q4_1_reader, hf_model, expert_type=expert_type)
    assert "quantization_config" not in ModelConfig.from_dir(resolve_model(str(path))).raw
    weights = dict(iterate_weights(resolve_model(str(path))))
    up = _experts(hf_model.model.layers[2])["ffn_up_exps.weight"]
    got = weights["model.layers.2.mlp.experts.up_proj.weight"]
    want = {
        T.F16: torch.from_numpy(up).half(),
        T.BF16: torch.from_numpy(up).bfloat16(),
        T.Q8_0: torch.from_numpy(_as_stored(up, T.Q8_0)),
    }[expert_type]
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_experts_mixing_mxfp4_with_another_type_are_refused(tmp_path, q4_1_reader):
    hf_model = _hf_model()
    path = _write(
        tmp_path / "mixed.gguf",
        q4_1_reader,
        hf_model,
        expert_type=T.MXFP4,
        overrides={"blk.1.ffn_up_exps.weight": T.Q8_0},
    )
    with pytest.raises(
        ValueError,
        match=r"gpt-oss expert weights mix MXFP4 \(blk\.0\.ffn_gate_exps\.weight\) with Q8_0 "
        r"\(blk\.1\.ffn_up_exps\.weight\); Pagoda holds a gpt-oss model's experts all as MXFP4",
    ):
        read_gguf(path)


def test_mxfp4_outside_the_experts_is_refused(tmp_path, q4_1_reader):
    hf_model = _hf_model()
    path = _write(tmp_path / "q.gguf", q4_1_reader, hf_model, overrides={"blk.0.attn_q.weight": T.MXFP4})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has GGML type MXFP4, which Pagoda does not load"):
        read_gguf(path)


@pytest.mark.parametrize(
    "split",
    [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)],
    ids=["tp2", "ep2"],
)
def test_mxfp4_file_split_over_two_ranks_generates_one_ranks_tokens(tmp_path, q4_1_reader, split):
    """Each rank reads its slice of the file's rows-first experts (gate and up rows, down's columns in whole
    MXFP4 blocks, or whole experts): the same tokens as one rank, over gloo."""
    hf_model = _hf_model()
    path = _write(tmp_path / "mxfp4.gguf", q4_1_reader, hf_model, expert_type=T.MXFP4, other_type=T.Q8_0)
    args = dict(max_num_batched_tokens=48, num_kv_blocks=64, cpu_threads_bind="none")
    runs = [greedy_with_first_logprobs(path, random_prompts(), NEW_TOKENS, **s, **args) for s in ({}, split)]
    compare_runs(runs, min_identical=len(random_prompts()))


def test_joined_gate_and_up_refuse_tensor_parallel_naming_the_way_out(tmp_path, q4_1_reader):
    """ffn_gate_up_exps cannot be cut as one slice per rank: the error says to use expert parallel."""
    from pagoda.engine_core.parallel.distributed import TPGroup

    path = _write(tmp_path / "fused.gguf", q4_1_reader, _hf_model(), expert_type=T.MXFP4, fused=True)
    model_dir = resolve_model(str(path))
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), group=TPGroup(0, 2))
