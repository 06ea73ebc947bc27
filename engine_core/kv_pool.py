"""A model's KV pool tensor, laid out by its KV groups (engine_core/kv_groups.py), and its binding into the
model's attention layers: the target model's (engine_core/model_runner.py) and a draft's
(engine_core/speculative/draft_model.py) are built the same way."""

from __future__ import annotations

import torch

from pagoda.engine_core.kv_groups import KVLayout, plan_layout


def plan_model_layout(model, windows: list[int | None], split: bool) -> KVLayout:
    """The KV groups of `model`'s attention layers that keep K/V (those not reading another layer's,
    `kv_sources`), each with its K/V shape, given every model layer's window."""
    sources = model.kv_sources()
    keeping = [
        (index, (attention.num_kv_heads, attention.head_dim))
        for index, attention in zip(model.attention_layer_indices(), model.attention_layers(), strict=True)
        if sources[index] == index
    ]
    return plan_layout(windows, [index for index, _ in keeping], split, [shape for _, shape in keeping])


def kv_bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes in a pool: keys and values of `block_size` tokens in each of the layout's
    slots, each token's row `row_elements` wide."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layout.slots * block_size * layout.row_elements * element


def allocate_pool(layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[slots, 2 (keys, values), blocks, block_size x row_elements], not written (torch.empty; the caller
    zeroes what it must)."""
    shape = (layout.slots, 2, num_blocks, block_size * layout.row_elements)
    return torch.empty(shape, dtype=dtype, device=device)


def bind_pool(model, layout: KVLayout, pool: torch.Tensor, block_size: int) -> None:
    """Bind each attention layer its KV group and its slot's keys and values, seen in its own heads and head
    size (a group with smaller rows sees `block_scale` times the blocks); a layer that reads another's K/V
    (`kv_sources`) gets that layer's, and writes none."""
    sources = model.kv_sources()
    num_blocks = pool.shape[2]
    for index, attention in zip(model.attention_layer_indices(), model.attention_layers(), strict=True):
        attention.kv_group, slot = layout.place(sources[index])
        attention.block_scale = layout.block_scale(attention.kv_group)
        heads, head_size = layout.groups[attention.kv_group].shape
        as_blocks = (num_blocks * attention.block_scale, block_size, heads, head_size)
        attention.key_cache = pool[slot, 0].view(as_blocks)
        attention.value_cache = pool[slot, 1].view(as_blocks)
        attention.writes_kv = sources[index] == index
