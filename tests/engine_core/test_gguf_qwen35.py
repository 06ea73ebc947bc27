"""Qwen3.5 GGUF files (llama.cpp's "qwen35" / "qwen35moe", engine_core/gguf_qwen35.py): written with the `gguf`
package from the tiny random Qwen3.5 models of tests/tiny_models.py the way llama.cpp's convert_hf_to_gguf.py
writes them (`_converted`: its names, -exp(A_log), 1 + w norms, the squeezed conv1d, the value heads tiled, the
experts stacked, its metadata keys), with test_gguf_gemma.py's small byte-level tokenizer, then served directly.
The float32 file loads into exactly the parameters of the checkpoint it was written from and gives Hugging Face's
greedy tokens on it; a Q8_0 file gives our own float32 run of its dequantized weights.

The tiny MoE model is built here with the default layer kinds (three linear-attention layers, then a full one):
a file says which layers are full attention only by `full_attention_interval`, as llama.cpp reads it.

transformers (5.25) reads these files too (`gguf_file=`, its own undoing of the converter's transforms): its
model gives our tokens. A multi-token-prediction block (`nextn_predict_layers`) is read past."""

from __future__ import annotations

import gc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.loader import load_model, resolve_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models
from tests.engine_core.gguf_files import float32_dir, tiny_tokenizer_metadata, write_gguf
from tests.helpers import greedy_with_first_logprobs, hf_greedy, run_engine

T = GGMLQuantizationType
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
VOCAB = 512
NEW_TOKENS = 12
LENGTHS = (1, 7, 30)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
DEFAULT_KINDS = ["linear_attention"] * 3 + ["full_attention"]  # (full_attention_interval 4)


@pytest.fixture(scope="module", params=tiny_models.QWEN3_5)
def family(request):
    """(name, HF model) with the layer kinds a file can say."""
    return request.param, tiny_models.build(request.param, layer_types=DEFAULT_KINDS)


@pytest.fixture(scope="module")
def f32_file(family, tmp_path_factory) -> Path:
    name, hf_model = family
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    write_gguf(path, None, _converted(hf_model), _metadata(hf_model, ARCH[name]))
    return path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _tiled(tensor: torch.Tensor, dim: int, key_heads: int, per_key: int, head_size: int) -> torch.Tensor:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled, along `dim`."""
    shape = list(tensor.shape)
    tensor = tensor.reshape(*shape[:dim], key_heads, per_key, head_size, *shape[dim + 1 :])
    return tensor.transpose(dim, dim + 1).contiguous().reshape(shape)


def _converted(model, matrices=lambda name, array: T.F32) -> list:
    """The model's tensors as llama.cpp's Qwen3.5 converter writes them; `matrices(gguf name, array)` chooses the
    type of each 2-D and 3-D tensor (vectors stay F32)."""
    cfg = model.config
    key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    per_key, value_dim = value_heads // key_heads, cfg.linear_value_head_dim
    key_rows = 2 * key_heads * cfg.linear_key_head_dim
    arch = gguf.MODEL_ARCH.QWEN35MOE if getattr(cfg, "num_experts", 0) else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    out = []

    def add(hf_name: str, tensor: torch.Tensor) -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        array = tensor.detach().float().numpy()
        ggml_type = T.F32 if array.ndim == 1 else matrices(name, array)
        out.append((name, np.ascontiguousarray(array), ggml_type))

    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        # _LinearAttentionVReorderBase: the value heads tiled
        if per_key > 1 and ".linear_attn." in name:
            if ".in_proj_qkv." in name:
                tensor = torch.cat((tensor[:key_rows], _tiled(tensor[key_rows:], 0, key_heads, per_key, value_dim)))
            elif ".in_proj_z." in name:
                tensor = _tiled(tensor, 0, key_heads, per_key, value_dim)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                tensor = _tiled(tensor, 0, key_heads, per_key, 1)
            elif ".conv1d." in name:
                tensor = tensor.squeeze()
                tensor = torch.cat((tensor[:key_rows], _tiled(tensor[key_rows:], 0, key_heads, per_key, value_dim)))
            elif ".out_proj." in name:
                tensor = _tiled(tensor, 1, key_heads, per_key, value_dim)
        # Qwen3NextModel
        if name.endswith(".A_log"):
            tensor = -torch.exp(tensor)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            tensor = tensor.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1
        # Qwen2MoeModel: stacked experts, gate_up split; the shared expert's gate a vector
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            add(name.replace("gate_up_proj", "gate_proj.weight"), tensor[:, :inter])
            add(name.replace("gate_up_proj", "up_proj.weight"), tensor[:, inter:])
            continue
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        if name.endswith("shared_expert_gate.weight"):
            tensor = tensor.squeeze(0)
        add(name, tensor)
    return out


def _metadata(model, arch: str) -> dict:
    """The keys the converter writes from the model's config (Qwen3NextModel.set_gguf_parameters and its bases)."""
    cfg = model.config
    rope = cfg.rope_parameters
    keys = {
        "context_length": (cfg.max_position_embeddings, U32),
        "embedding_length": (cfg.hidden_size, U32),
        "block_count": (cfg.num_hidden_layers, U32),
        "attention.head_count": (cfg.num_attention_heads, U32),
        "attention.head_count_kv": (cfg.num_key_value_heads, U32),
        "attention.key_length": (cfg.head_dim, U32),
        "attention.value_length": (cfg.head_dim, U32),
        "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, F32),
        "rope.freq_base": (rope["rope_theta"], F32),
        "rope.dimension_count": (int(cfg.head_dim * rope["partial_rotary_factor"]), U32),
        "rope.dimension_sections": ([11, 11, 10, 0], GGUFValueType.ARRAY),
        "ssm.conv_kernel": (cfg.linear_conv_kernel_dim, U32),
        "ssm.state_size": (cfg.linear_key_head_dim, U32),
        "ssm.group_count": (cfg.linear_num_key_heads, U32),
        "ssm.time_step_rank": (cfg.linear_num_value_heads, U32),
        "ssm.inner_size": (cfg.linear_value_head_dim * cfg.linear_num_value_heads, U32),
        "full_attention_interval": (4, U32),
    }
    if arch == "qwen35moe":
        keys |= {
            "expert_count": (cfg.num_experts, U32),
            "expert_used_count": (cfg.num_experts_per_tok, U32),
            "expert_feed_forward_length": (cfg.moe_intermediate_size, U32),
            "expert_shared_feed_forward_length": (cfg.shared_expert_intermediate_size, U32),
        }
    else:
        keys["feed_forward_length"] = (cfg.intermediate_size, U32)
    out = {f"{arch}.{key}": value for key, value in keys.items()}
    out["general.architecture"] = (arch, GGUFValueType.STRING)
    return out | tiny_tokenizer_metadata()


def test_the_config_is_hfs(f32_file, family):
    """config.json's sizes, linear attention, layer kinds, partial rotary and MoE fields are HF's."""
    name, hf_model = family
    cfg = ModelConfig.from_dir(resolve_model(str(f32_file)))
    theirs = hf_model.config
    assert cfg.architecture == {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[name]
    assert cfg.layer_types == tuple(theirs.layer_types) and cfg.head_dim == theirs.head_dim
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"] and not cfg.tie_word_embeddings
    assert cfg.raw["partial_rotary_factor"] == theirs.rope_parameters["partial_rotary_factor"]
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        assert cfg.raw[key] == getattr(theirs, key), key
    assert cfg.raw["linear_conv_kernel_dim"] == theirs.linear_conv_kernel_dim
    if name == "qwen3_5_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
        assert cfg.shared_expert_intermediate_size == 48 and cfg.norm_topk_prob


def test_the_file_loads_as_the_checkpoint(f32_file, family, tmp_path):
    """Every parameter of our model from the file equals, bit for bit, the one from the HF checkpoint it was
    written from: the value heads back in HF's order, A_log from -exp(A_log), the conv1d's shape, the 1 + w
    norms as HF's checkpoint loads them (1 + w in float32, with no second one)."""
    _, hf_model = family
    hf_model.save_pretrained(tmp_path)
    from_file_dir = resolve_model(str(f32_file))
    from_file = load_model(from_file_dir, ModelConfig.from_dir(from_file_dir), torch.float32, torch.device("cpu"))
    from_hf = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))
    ours, theirs = dict(from_file.named_parameters()), dict(from_hf.named_parameters())
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert any(key.endswith("A_log") for key in ours)


def test_a_float32_file_serves_like_hf(f32_file, family):
    """Greedy tokens HF's on the checkpoint the file was written from."""
    _, hf_model = family
    prompts = _prompts()
    ours, _ = greedy_with_first_logprobs(f32_file, prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    assert ours == [hf_greedy(hf_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]


def _q8_0(name: str, array: np.ndarray) -> GGMLQuantizationType:
    """Q8_0 where the rows are whole blocks of 32 (the shared expert's down projection, 48 wide, stays F32)."""
    return T.Q8_0 if array.shape[-1] % 32 == 0 else T.F32


def test_a_q8_0_file_serves_like_its_float32_dequantization(tmp_path, family):
    """Q8_0 linears load into the GGUF quantization method (the linear attention's merged in_proj too, its value
    rows put back as whole quantized rows); ssm_out, whose 24-wide heads split its 32-value blocks, is dequantized
    at load. The tokens are our float32 run of the file's dequantized weights."""
    name, hf_model = family
    path = tmp_path / f"{name}-q8_0.gguf"
    write_gguf(path, None, _converted(hf_model, _q8_0), _metadata(hf_model, ARCH[name]))
    engine = EngineCore(EngineConfig(model=str(path), num_kv_blocks=64))
    model = engine.runner.model
    linear_attention = model.decoder_layers()[0].linear_attn
    assert linear_attention.in_proj.quantized.bits == 8 and model.lm_head.quantized.bits == 8
    assert linear_attention.out_proj.weight.dtype == torch.float32  # (dequantized)
    prompts = _prompts()
    ours = run_engine(engine, prompts, GREEDY)
    del engine, model, linear_attention
    gc.collect()
    reference, _ = greedy_with_first_logprobs(float32_dir(path), prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    assert ours == reference


def test_float_alpha_and_beta_beside_quantized_projections(tmp_path):
    """ssm_alpha / ssm_beta kept float (as quantized files of real models keep them) beside a Q8_0 attn_qkv and
    attn_gate: that merged in_proj loads float whole (its quantized parts dequantized), the rest stays quantized;
    the tokens are our float32 run of the file's dequantized weights."""
    hf_model = tiny_models.build("qwen3_5", layer_types=DEFAULT_KINDS)

    def choose(name: str, array: np.ndarray) -> GGMLQuantizationType:
        return T.F32 if ".ssm_alpha." in name or ".ssm_beta." in name else _q8_0(name, array)

    path = tmp_path / "qwen3_5-float-alpha-beta.gguf"
    write_gguf(path, None, _converted(hf_model, choose), _metadata(hf_model, "qwen35"))
    engine = EngineCore(EngineConfig(model=str(path), num_kv_blocks=64))
    model = engine.runner.model
    in_proj = model.decoder_layers()[0].linear_attn.in_proj
    assert in_proj.quantized is None and in_proj.weight.dtype == torch.float32
    assert model.decoder_layers()[0].mlp.gate_up_proj.quantized.bits == 8
    prompts = _prompts()
    ours = run_engine(engine, prompts, GREEDY)
    del engine, model, in_proj
    gc.collect()
    reference, _ = greedy_with_first_logprobs(float32_dir(path), prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    assert ours == reference


@pytest.mark.parametrize(("spec", "shape"), [("v,0,64,2,3,32", (64 + 6 * 32, 64)), ("v,1,0,2,3,32", (16, 6 * 32))])
def test_quantized_blocks_move_as_their_values(spec, shape):
    """Rows (attn_qkv's value rows) and, where a head is whole blocks, columns (ssm_out's): the raw Q8_0 blocks put
    in order dequantize to the dequantized tensor put in order."""
    from gguf.quants import dequantize, quantize

    from pagoda.engine_core.gguf_qwen35 import blocks_move_whole, blocks_to_hf, to_hf

    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    blocks = quantize(array, T.Q8_0)
    assert blocks_move_whole(spec, "Q8_0")
    moved = dequantize(blocks_to_hf(blocks, spec, "Q8_0"), T.Q8_0)
    assert np.array_equal(moved, to_hf(dequantize(blocks, T.Q8_0), spec))
    assert not np.array_equal(moved, dequantize(blocks, T.Q8_0))


def test_transformers_reads_the_file_as_we_do(f32_file, family):
    """transformers' own GGUF reader (5.25 reads qwen35 / qwen35moe files: its own undoing of the converter's
    transforms) gives our tokens. (It takes the one off each norm and HF's model adds it back, which can round in
    principle; on these models every token agrees.)"""
    from transformers import AutoModelForCausalLM

    directory, name = str(f32_file.parent), f32_file.name
    theirs_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    assert theirs_model.config.layer_types == family[1].config.layer_types
    prompts = _prompts()
    ours, _ = greedy_with_first_logprobs(f32_file, prompts, new_tokens=NEW_TOKENS, num_kv_blocks=64)
    theirs = [hf_greedy(theirs_model, p, NEW_TOKENS, stop_at_eos=False) for p in prompts]
    assert ours == theirs


def test_a_multi_token_prediction_block_is_skipped(family, tmp_path):
    """A file with the converter's MTP block (one more block, `nextn_predict_layers` 1): the model has the
    checkpoint's layers and parameters, the extra block's tensors are read past."""
    name, hf_model = family
    arch = ARCH[name]
    tensors = _converted(hf_model)
    last = hf_model.config.num_hidden_layers - 1
    extra = [
        (n.replace(f"blk.{last}.", f"blk.{last + 1}."), a, t) for n, a, t in tensors if n.startswith(f"blk.{last}.")
    ]
    extra.append((f"blk.{last + 1}.nextn.eh_proj.weight", np.ones((64, 128), np.float32), T.F32))
    meta = _metadata(hf_model, arch)
    meta[f"{arch}.block_count"] = (last + 2, U32)
    meta[f"{arch}.nextn_predict_layers"] = (1, U32)
    path = tmp_path / f"{name}-mtp.gguf"
    write_gguf(path, None, tensors + extra, meta)
    model_dir = resolve_model(str(path))
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.num_layers == last + 1
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    hf_model.save_pretrained(tmp_path / "hf")
    reference = load_model(tmp_path / "hf", ModelConfig.from_dir(tmp_path / "hf"), torch.float32, torch.device("cpu"))
    theirs = dict(reference.named_parameters())
    assert all(torch.equal(value, theirs[key]) for key, value in model.named_parameters())
