"""Qwen3.5 (engine_core/models/qwen3_5.py) against Hugging Face's models on the same weights: tiny random dense
and MoE checkpoints built here (float32), loaded through the loader's path from their saved safetensors.

These tests play the model runner (tests/engine_core/test_qwen3_5.py runs the engine's): they bind each
linear-attention layer's state pools and each full-attention layer's paged KV cache, and build each step's
`AttentionMetadata` (decodes first, then prefill sequences) with the sequences' state slots and which of
them start fresh. Checked: whole prompts in one step (alone, and a varlen
batch of three) and as a pooling step; prefill then 16 greedy decode steps of a batch, the tokens HF
generate's and the logits HF's at each step, with a prompt joining mid-way in a slot its previous owner left
dirty and a prompt split into two prefill chunks; stacked-expert and vision-language checkpoint names; the
(1 + w) norms and the attention's output gate change the logits (so the equality tests them); int8 at load.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagoda.engine_core import loader
from pagoda.engine_core.layers.attention import AttentionMetadata, VarlenMetadata
from pagoda.engine_core.layers.rotary import RotaryEmbedding
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from pagoda.engine_core.quantization import resolve_method
from tests import tiny_models
from tests.quantization_helpers import write_dequantized_checkpoint

BLOCK_SIZE = 8
NUM_BLOCKS = 64
NEW_TOKENS = 16
LOGITS = dict(atol=1e-3, rtol=1e-4)  # (float32, logits ~10: only summation order differs, over up to 16 steps)

# family -> the tiny model (tests/tiny_models.py: dense with HF's default layer types, three linear-attention
# layers then a full one; MoE with a full layer in the middle and a linear one last, which the step's kept
# rows meet)
FAMILIES = {"dense": "qwen3_5", "moe": "qwen3_5_moe"}
CLASSES = {"dense": Qwen3_5ForCausalLM, "moe": Qwen3_5MoeForCausalLM}


def build_hf(family: str):
    return tiny_models.build(FAMILIES[family])


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, HF model, its checkpoint directory)."""
    model = build_hf(request.param)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return request.param, model, out


def load_ours(model_dir, cls=None, quantization=None) -> Qwen3_5ForCausalLM:
    """Built and filled as the engine's loader does (loader.load_model, with the class given: the family is
    not registered while the engine cannot run it)."""
    cfg = ModelConfig.from_dir(model_dir)
    cls = cls or CLASSES["moe" if cfg.is_moe else "dense"]
    args = (model_dir, cfg, torch.float32, torch.device("cpu"), "auto", quantization, None, None, None, False)
    return loader._load(cls, *args)


class Runner:
    """The model runner's part: state pools and a paged KV cache bound to the layers, per-sequence block
    tables and context lengths, one step's metadata."""

    def __init__(self, model: Qwen3_5ForCausalLM, num_slots: int = 6):
        self.model = model
        (conv_shape, conv_dtype), (state_shape, state_dtype) = model.recurrent_state_shapes()
        assert state_dtype == torch.float32
        for layer in model.recurrent_layers():  # (garbage: fresh slots must be zeroed by the layer)
            layer.conv_states = torch.randn(num_slots, *conv_shape, dtype=conv_dtype)
            layer.recurrent_states = torch.randn(num_slots, *state_shape, dtype=state_dtype)
        for attention in model.attention_layers():
            shape = (NUM_BLOCKS, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
            attention.key_cache, attention.value_cache = torch.zeros(shape), torch.zeros(shape)
        self.next_block = 0
        self.blocks: dict[int, list[int]] = {}  # sequence id -> its blocks
        self.lengths: dict[int, int] = {}  # sequence id -> tokens cached

    def step(self, seqs: list[tuple[int, int, list[int]]], last_rows: bool = False) -> torch.Tensor:
        """One step of (sequence id, state slot, new tokens): decodes (one token) first. Logits of every row,
        or with `last_rows` of each sequence's last row only, the only rows the step computes past the last
        layer's mixer (`output_rows`, as the engine's steps set it)."""
        decodes = 0
        while decodes < len(seqs) and len(seqs[decodes][2]) == 1 and self.lengths.get(seqs[decodes][0], 0) > 0:
            decodes += 1
        ids, positions, slot_mapping, seq_lens, tables, fresh, prefill_counts = [], [], [], [], [], [], []
        for index, (seq, _, tokens) in enumerate(seqs):
            start = self.lengths.get(seq, 0)
            fresh.append(start == 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.next_block)
                self.next_block += 1
            ids += tokens
            positions += range(start, end)
            slot_mapping += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            seq_lens.append(end)
            tables.append(blocks)
            if index >= decodes:
                prefill_counts.append(len(tokens))
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot_mapping]),  # (one KV group)
            num_decodes=decodes,
            seq_lens=torch.tensor(seq_lens),
            max_decode_seq_len=max(seq_lens[:decodes], default=0),
            block_tables=torch.tensor([[t + [0] * (width - len(t)) for t in tables]]),
            query_start_loc=torch.tensor([0, *prefill_counts]).cumsum(0),
            state_slots=torch.tensor([slot for _, slot, _ in seqs]),
            fresh_states=torch.tensor(fresh),
        )
        ends = torch.tensor([len(tokens) for _, _, tokens in seqs]).cumsum(0) - 1
        if last_rows:
            meta.output_rows = ends
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta)
            return self.model.compute_logits(hidden[ends] if last_rows else hidden)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


def prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (11, 1, 70)]  # (past a 64-token chunk)


def test_the_layers_are_hfs_kinds(saved):
    _, hf_model, model_dir = saved
    model = load_ours(model_dir)
    kinds = tuple(hf_model.config.layer_types)
    assert model.layer_types() == kinds
    assert len(model.recurrent_layers()) == kinds.count("linear_attention")
    assert len(model.attention_layers()) == kinds.count("full_attention")
    assert model.attention_layer_indices() == [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    (conv_shape, conv_dtype), (state_shape, state_dtype) = model.recurrent_state_shapes()
    assert conv_shape == (3, 2 * 2 * 16 + 4 * 24) and conv_dtype == torch.float32
    assert state_shape == (4, 16, 24) and state_dtype == torch.float32
    assert model.layers[kinds.index("full_attention")].self_attn.rotary.cos_sin_cache.shape[1] == 8
    assert not model.recurrent_layers()[0].reads_host(torch.device("cpu"))  # (the C kernels read nothing there)


def test_a_prompt_in_one_step_is_hfs(saved):
    """Each prompt alone, then all three as one varlen step (every row's logits), and as a pooling step."""
    _, hf_model, model_dir = saved
    model = load_ours(model_dir)
    expected = [hf_logits(hf_model, p) for p in prompts()]
    for index, prompt in enumerate(prompts()):
        torch.testing.assert_close(Runner(model).step([(index, 2, prompt)]), expected[index], **LOGITS)
    batch = Runner(model).step([(i, slot, p) for i, (slot, p) in enumerate(zip([4, 0, 2], prompts(), strict=True))])
    torch.testing.assert_close(batch, torch.cat(expected), **LOGITS)
    meta = VarlenMetadata(query_start_loc=torch.tensor([0, *map(len, prompts())]).cumsum(0))
    flat = torch.tensor([t for p in prompts() for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts()])
    with torch.no_grad():
        pooled = model.compute_logits(model(flat, positions, meta))
    torch.testing.assert_close(pooled, torch.cat(expected), **LOGITS)


def test_prefill_then_decode_is_hf_generate(saved):
    """Two prompts prefilled together, then greedy decode steps with a third prompt joining at step 5 in the
    slot a finished sequence left (its state must be zeroed), and a fourth prefilled in two chunks: tokens
    equal HF generate's, logits HF's at every step."""
    _, hf_model, model_dir = saved
    model = load_ours(model_dir)
    runner = Runner(model)
    first, second, third = prompts()
    fourth = prompts(seed=2)[2]
    want = {}
    for seq, prompt in enumerate((first, second, third, fourth)):
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        want[seq] = (out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits))
    runner.step([(9, 3, [5, 6, 7])])  # (a sequence that leaves slot 3 dirty)
    slots = {0: 0, 1: 1, 2: 3, 3: 5}
    logits = runner.step([(0, slots[0], first), (1, slots[1], second)], last_rows=True)
    rows = {0: [logits[0]], 1: [logits[1]]}
    got = {seq: [int(rows[seq][0].argmax())] for seq in rows}
    chunk = len(fourth) // 2
    runner.step([(3, slots[3], fourth[:chunk])])  # (a first chunk: its logits are not read)
    rows[3], got[3] = [], []
    pending = {2: third, 3: fourth[chunk:]}  # (joining at steps 5 and 7)
    for step in range(1, 3 * NEW_TOKENS):
        seqs = [(seq, slots[seq], [got[seq][-1]]) for seq in got if got[seq] and len(got[seq]) < NEW_TOKENS]
        for seq, join_step in ((2, 5), (3, 7)):
            if step == join_step:
                seqs.append((seq, slots[seq], pending[seq]))
                got.setdefault(seq, [])
                rows.setdefault(seq, [])
        if not seqs:
            break
        logits = runner.step(seqs, last_rows=True)
        for (seq, _, _), row in zip(seqs, logits, strict=True):
            rows[seq].append(row)
            got[seq].append(int(row.argmax()))
    for seq, (tokens, hf_step_logits) in want.items():
        assert got[seq] == tokens, seq
        torch.testing.assert_close(torch.stack(rows[seq]), hf_step_logits, **LOGITS)


def test_what_qwen3_5_adds_changes_the_logits(saved):
    """Undone in our model, the (1 + w) norm and the partial rotary embedding change the logits (so the
    equality with HF's tests them)."""
    _, hf_model, model_dir = saved
    prompt = prompts()[0]
    expected = hf_logits(hf_model, prompt)
    model = load_ours(model_dir)
    torch.testing.assert_close(Runner(model).step([(0, 0, prompt)]), expected, **LOGITS)
    model.layers[0].input_layernorm.weight.sub_(1.0)  # (Llama's w instead of 1 + w)
    assert not torch.allclose(Runner(model).step([(0, 0, prompt)]), expected, **LOGITS)
    model = load_ours(model_dir)
    full = RotaryEmbedding(model.cfg.head_dim, model.cfg.max_position_embeddings, model.cfg.rope_theta)
    for layer in model.layers:
        if layer.self_attn is not None:
            layer.self_attn.rotary = full  # (every dim rotated)
    assert not torch.allclose(Runner(model).step([(0, 0, prompt)]), expected, **LOGITS)


def test_stacked_experts_and_vision_language_names_load(saved, tmp_path):
    """A checkpoint as a vision-language model's text model (`model.language_model.`, with vision tower
    and MTP tensors to skip), its experts stacked as transformers holds them: the same logits."""
    family, hf_model, model_dir = saved
    tensors = load_file(model_dir / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        renamed[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = tensor
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["mtp.layers.0.input_layernorm.weight"] = torch.zeros(3)
    if family == "moe":
        for layer in range(hf_model.config.num_hidden_layers):
            prefix = f"model.language_model.layers.{layer}.mlp.experts"
            experts = range(hf_model.config.num_experts)
            gate_up = [
                torch.cat([renamed.pop(f"{prefix}.{e}.gate_proj.weight"), renamed.pop(f"{prefix}.{e}.up_proj.weight")])
                for e in experts
            ]
            renamed[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            renamed[f"{prefix}.down_proj"] = torch.stack(
                [renamed.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
            )
    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    model = load_ours(tmp_path, CLASSES[family] if family == "moe" else Qwen3_5ForConditionalGeneration)
    prompt = prompts()[0]
    torch.testing.assert_close(Runner(model).step([(0, 1, prompt)]), hf_logits(hf_model, prompt), **LOGITS)


def test_int8_at_load_computes_its_dequantized_weights(saved, tmp_path):
    """`quantization="int8"` (the linears, the linear attention's merged input projection among them, and the
    experts quantized as they load): the logits of a float32 checkpoint holding exactly its dequantized weights
    (as tests/engine_core/test_gemma.py compares), and most greedy picks HF's float model's."""
    family, hf_model, model_dir = saved
    model = load_ours(model_dir, quantization=resolve_method("int8", ModelConfig.from_dir(model_dir).raw))
    assert model.recurrent_layers()[0].in_proj.quantized is not None
    if family == "moe":
        assert model.layers[0].mlp.packed13 is not None
    prompt = prompts()[2]
    ours = Runner(model).step([(0, 0, prompt)])
    reference = write_dequantized_checkpoint(model, model_dir, tmp_path / "dequantized")
    tensors = load_file(reference / "model.safetensors")  # (our (1 + w) norms hold 1 + w: the checkpoint's are w)
    one_plus_w = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
    save_file(
        {n: t - 1.0 if n.endswith(one_plus_w) else t for n, t in tensors.items()}, reference / "model.safetensors"
    )
    torch.testing.assert_close(ours, Runner(load_ours(reference)).step([(0, 0, prompt)]), **LOGITS)
    assert (ours.argmax(-1) == hf_logits(hf_model, prompt).argmax(-1)).float().mean() > 0.8


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
VISION_LANGUAGE = {"dense": transformers.Qwen3_5Config, "moe": transformers.Qwen3_5MoeConfig}
VL_CLASSES = {"dense": Qwen3_5ForConditionalGeneration, "moe": Qwen3_5MoeForConditionalGeneration}


@pytest.mark.parametrize("family", list(VISION_LANGUAGE))
def test_a_vision_language_checkpoint_serves_its_text_model(family, tmp_path):
    """HF's Qwen3_5(Moe)ForConditionalGeneration, saved as transformers saves it (config under text_config,
    tensors under model.language_model., a vision tower to skip), generating from a text prompt through its
    own position ids (mrope, the same position on every section): our text model's tokens and logits. The
    dense one ties its embeddings (the config's top-level switch, as Qwen3.5's small models do)."""
    _, text = tiny_models.ARCHITECTURES[FAMILIES[family]]
    text_config = {**tiny_models.COMMON, **text}
    if family == "moe":
        text_config.pop("intermediate_size")  # (an all-MoE config has none)
    special = dict(image_token_id=508, video_token_id=509, vision_start_token_id=510, vision_end_token_id=511)
    tied = family == "dense"
    text_config["tie_word_embeddings"] = tied
    config = VISION_LANGUAGE[family](text_config=text_config, vision_config=VISION, tie_word_embeddings=tied, **special)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in hf_model.model.language_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                parameter.normal_(std=0.5)
    hf_model.save_pretrained(tmp_path)
    prompt = prompts()[0]
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    model = load_ours(tmp_path, VL_CLASSES[family])
    assert model.cfg.architecture == type(hf_model).__name__
    assert (model.embed_tokens is None) == tied
    runner = Runner(model)
    logits = [runner.step([(0, 1, prompt)])[-1]]
    for _ in range(NEW_TOKENS - 1):
        logits.append(runner.step([(0, 1, [int(logits[-1].argmax())])])[0])
    assert [int(row.argmax()) for row in logits] == out.sequences[0, len(prompt) :].tolist()
    torch.testing.assert_close(torch.stack(logits), torch.cat(out.logits), **LOGITS)
