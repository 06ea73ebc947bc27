"""How tensor parallel splits a model, without processes: which heads each rank holds, and each rank's
piece of a quantized linear (its columns with their groups' scales, act-order groups regrouped) computing
exactly its share of the whole layer; the shared-memory all-reduce. The engine under tensor parallel:
test_tensor_parallel.py."""

from __future__ import annotations

import threading

import pytest
import torch

from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.parallel.sharding import AttentionHeads, check_model_splits, split_rows, split_vocab
from pagoda.engine_core.parallel.shm_allreduce import ShmAllReduce, create_file
from pagoda.engine_core.quantization.at_load import quantize_int4_grouped, quantize_int8_per_channel
from pagoda.engine_core.quantization.base import QuantizedShard, pack_shards, shard_columns
from pagoda.kernels import ops


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world"),
    [(8, 2, 2), (9, 3, 2), (9, 3, 3), (8, 1, 2), (8, 2, 4), (8, 8, 8), (12, 4, 8), (32, 8, 4), (14, 2, 4)],
)
def test_every_query_head_is_held_once_beside_its_kv_head(heads, kv_heads, world):
    group = heads // kv_heads
    spans = [AttentionHeads(heads, kv_heads).of_rank(rank, world) for rank in range(world)]
    held = [h for q, _ in spans for h in range(q.start, q.stop)]
    assert held == list(range(heads))  # in rank order, each once
    for q, kv in spans:
        assert q.size >= 1 and kv.size >= 1
        assert all(kv.start <= h // group < kv.stop for h in range(q.start, q.stop))
    if world > kv_heads:  # replicated: every rank holds one K/V head
        assert all(kv.size == 1 for _, kv in spans)


def test_smollm2_heads_split_unevenly_over_two_ranks():
    # 9 query heads in 3 groups: rank 0 holds one K/V head and its 3 query heads, rank 1 the other two.
    (q0, kv0), (q1, kv1) = (AttentionHeads(9, 3).of_rank(rank, 2) for rank in range(2))
    assert (q0.start, q0.size, kv0.start, kv0.size) == (0, 3, 0, 1)
    assert (q1.start, q1.size, kv1.start, kv1.size) == (3, 6, 1, 2)


def test_rows_and_vocabulary_cover_the_dimension():
    assert [split_rows(10, r, 4).size for r in range(4)] == [2, 3, 2, 3]
    assert [(s.start, s.size) for s in (split_vocab(10, r, 4) for r in range(4))] == [(0, 3), (3, 3), (6, 3), (9, 1)]


def _config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=100,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        sliding_window=None,
    )
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({}, 3, "cannot split 8 attention heads with 2 key/value heads"),
        ({"num_heads": 4, "num_kv_heads": 4}, 8, "at most 4"),
        ({"vocab_size": 5}, 4, "too large for a vocabulary of 5"),
    ],
)
def test_models_that_do_not_split_are_refused_up_front(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        check_model_splits(_config(**overrides), world)
    check_model_splits(_config(**overrides), 1)


def _rank_output(shard: QuantizedShard, x: torch.Tensor) -> torch.Tensor:
    return ops.quantized_linear(x, pack_shards("layer", [shard]), None)


def test_row_pieces_of_a_grouped_weight_add_up_to_the_whole_layer():
    torch.manual_seed(0)
    weight, x = torch.randn(48, 256), torch.randn(5, 256)
    whole = quantize_int4_grouped(weight, 32)
    expected = x @ whole.dequantize().t()
    total = torch.zeros(5, 48)
    for rank in range(4):
        piece = shard_columns("layer", whole, rank * 64, (rank + 1) * 64, 4)
        assert torch.equal(piece.dequantize(), whole.dequantize()[:, rank * 64 : (rank + 1) * 64])
        total += _rank_output(piece, x[:, rank * 64 : (rank + 1) * 64])
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


def test_per_channel_scales_stay_whole_on_every_rank():
    whole = quantize_int8_per_channel(torch.randn(16, 96))
    piece = shard_columns("layer", whole, 48, 96, 2)
    assert torch.equal(piece.scales, whole.scales)
    assert torch.equal(piece.dequantize(), whole.dequantize()[:, 48:])


def test_a_group_split_between_ranks_is_a_clear_error():
    whole = quantize_int4_grouped(torch.randn(8, 96), 32)  # 96 columns over 2 ranks: 48, not a multiple of 32
    with pytest.raises(ValueError, match=r"layer: tensor-parallel size 2 gives each rank 48 .* group size 32"):
        shard_columns("layer", whole, 0, 48, 2)


@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False)])
def test_act_order_pieces_regroup_their_columns_and_add_up_to_the_whole_layer(bits, symmetric):
    """GPTQ act-order: each group's columns are scattered over the input, so a rank holds part of every
    group; its piece pads each group to whole blocks with zero-weight columns and reads its inputs
    through `input_columns`."""
    torch.manual_seed(1)
    n, k, group = 24, 256, 64
    g_idx = torch.randperm(k) % (k // group)  # a shuffled assignment, group columns each
    scales = (torch.rand(n, k // group) * 0.1 + 0.01).half().float()  # (packed weights hold float16 scales)
    zeros = torch.full((n, k // group), 1 << (bits - 1)) if symmetric else torch.randint(0, 1 << bits, (n, k // group))
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32)
    mins = None if symmetric else -zeros.float() * scales
    whole = QuantizedShard(q, scales, mins, bits, group, g_idx)
    x = torch.randn(3, k)
    expected = x @ whole.dequantize().t()
    total = torch.zeros(3, n)
    for rank in range(2):
        columns = slice(rank * k // 2, (rank + 1) * k // 2)
        piece = shard_columns("layer", whole, columns.start, columns.stop, 2)
        assert piece.input_columns is not None and piece.q.shape[1] % 32 == 0
        torch.testing.assert_close(piece.dequantize(), whole.dequantize()[:, columns])
        total += _rank_output(piece, x[:, columns])
    # float32 roundoff of the sums in another order (the 8-bit kernel adds 128 x scale apart): ~1e-6 of
    # the largest sum of |terms|; a wrong column, group or scale is off by far more
    roundoff = 1e-6 * float((x.abs() @ whole.dequantize().abs().t()).max())
    torch.testing.assert_close(total, expected, atol=roundoff, rtol=0)


def _shm_pair(tmp_path, peers_alive=lambda: True, timeout_s=60.0):
    path = str(tmp_path / "allreduce")
    create_file(path, 2, slot_bytes=1 << 16)
    return [ShmAllReduce(path, rank, 2, peers_alive, timeout_s, slot_bytes=1 << 16) for rank in range(2)]


def test_shared_memory_all_reduce_sums_in_rank_order_on_both_ranks(tmp_path):
    """Two ranks (threads here; processes in the engine) through 300 all-reduces of varying sizes and
    dtypes: both get rank 0's part + rank 1's, bit for bit, every time (the slots alternate)."""
    ranks = _shm_pair(tmp_path)
    gen = torch.Generator().manual_seed(0)
    shapes = [(int(torch.randint(1, 64, (1,), generator=gen)), 96) for _ in range(300)]
    inputs = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(2)]
    inputs[1][7] = inputs[1][7].bfloat16()
    inputs[0][7] = inputs[0][7].bfloat16()
    results: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        for tensor in inputs[rank]:
            out = tensor.clone()
            ranks[rank].all_reduce(out)
            results[rank].append(out)

    thread = threading.Thread(target=run, args=(1,))
    thread.start()
    run(0)
    thread.join()
    for i in range(len(shapes)):
        expected = inputs[0][i].clone()
        expected += inputs[1][i]
        assert torch.equal(results[0][i], expected) and torch.equal(results[1][i], expected), i
    for rank in ranks:
        rank.close()


def test_shared_memory_all_reduce_gives_up_on_a_peer_that_is_gone_or_late(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone = _shm_pair(tmp_path / "a", lambda: False)[0]
    # (Raising at all is the property: a rank that waited for ever would hang here.)
    with pytest.raises(RuntimeError, match="a tensor-parallel rank is gone"):
        alone.all_reduce(torch.ones(4))
    late = _shm_pair(tmp_path / "b", timeout_s=0.2)[0]
    with pytest.raises(RuntimeError, match=r"rank 1 did not join an all-reduce within 0\.2s"):
        late.all_reduce(torch.ones(4))
