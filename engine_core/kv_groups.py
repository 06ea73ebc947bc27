"""How a model's layers share the KV pool: groups of layers by attention kind (vLLM's hybrid allocator).

Each group has its own block table per request. Full-attention groups keep every block; a sliding-window
group gives back the blocks that have left a request's window (engine_core/kv_cache.py). All groups draw
block ids from one pool: a block id is owned by one group at a time, and holds the K/V of that group's
layers, one layer per slot. So the pool's tensor is [slots, 2, blocks, ...] with as many slots as the
largest group has layers, and layer l of a group keeps its K/V in slot l.

For the slots to be used well, the groups are equal in size: a kind with n layers splits into groups of
the smallest kind's count (Gemma 3's 5:1 pattern over 24 layers gives five sliding groups of 4 and one
full group of 4; gpt-oss's 12 + 12 gives one of each). A model whose layers are all of one kind is one
group, as before. So is a pipeline stage's or a model with a draft: the stages' layers would leave slots
empty, and a draft's K/V lives in blocks of the same ids; both keep every layer's blocks (one group,
sliding only where every layer slides alike).

Layers may differ in their K/V heads and head size (Gemma 4's full layers have wider heads, and fewer, than
its sliding ones): a group holds layers of one shape, and a block id then holds, per slot, as many elements
as the widest row needs (the least common multiple of the groups' rows: `row_elements`). A group whose
token row is smaller views the same memory as `block_scale` times as many blocks of its own shape, its
block b being pool block b / block_scale's first part; the attention layers scale their block ids by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KVShape = tuple[int, int]  # (K/V heads, head size) of a layer's cache, this rank's


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # the sliding window of its layers (None: full attention)
    layers: tuple[int, ...]  # the model's layer indices, in slot order
    shape: KVShape = (0, 0)  # its layers' K/V heads and head size

    @property
    def row(self) -> int:
        """Elements of one token's keys (or values) in one layer."""
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int  # layers' K/V per block id: the pool tensor's first dimension

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def row_elements(self) -> int:
        """Elements per token and slot in the pool: a multiple of every group's row (0: no layer keeps K/V)."""
        return math.lcm(*(group.row for group in self.groups))

    def block_scale(self, group: int) -> int:
        """How many of group `group`'s blocks one pool block spans (1 where its rows are the pool's)."""
        return self.row_elements // self.groups[group].row if self.groups[group].row else 1

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of layer `layer` (a model layer index)."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")

    def describe(self) -> str:
        kinds = []
        for group in self.groups:
            kind = "full" if group.window is None else f"sliding {group.window}"
            kinds.append(f"{kind} ({len(group.layers)} layers)")
        return ", ".join(kinds)


def plan_layout(windows: list[int | None], layers: Sequence[int], split: bool, shapes: Sequence[KVShape]) -> KVLayout:
    """The groups of the attention layers in `layers` (this rank's layers that keep K/V), given every model
    layer's window and each held layer's K/V shape (`shapes`, in the order of `layers`). `split=False`
    (pipeline stages, a draft model): one group of them all, sliding only where every layer slides alike,
    which needs every layer's K/V shape alike."""
    held = list(layers)
    if not held:  # (a pipeline stage of recurrent layers alone: no K/V to keep, an empty pool)
        return KVLayout((KVGroup(None, (), (0, 0)),), 0)
    shape_of = dict(zip(held, shapes, strict=True))
    kinds = list(dict.fromkeys((windows[i], shape_of[i]) for i in held))  # (in the order of their first layer)
    if not split or len(kinds) == 1:
        if len(set(shapes)) > 1:
            raise ValueError(
                "the model's layers keep K/V of different shapes "
                f"({', '.join(f'{h} heads of {d}' for h, d in dict.fromkeys(shapes))}), which needs a KV group "
                "per shape: not available with pipeline parallel or a draft model"
            )
        shared = set(windows)
        window = shared.pop() if len(shared) == 1 else None
        return KVLayout((KVGroup(window, tuple(held), shapes[0]),), len(held))
    by_kind = {kind: [i for i in held if (windows[i], shape_of[i]) == kind] for kind in kinds}
    size = min(len(members) for members in by_kind.values())
    groups = []
    for (window, shape), members in by_kind.items():
        for start in range(0, len(members), size):
            groups.append(KVGroup(window, tuple(members[start : start + size]), shape))
    return KVLayout(tuple(groups), size)
