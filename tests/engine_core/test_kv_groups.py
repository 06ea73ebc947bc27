"""KV groups of layers with different K/V shapes (engine_core/kv_groups.py): the pool's row is a multiple of
every group's, each group sees as many of its own blocks in a pool block as its rows fit; one group (pipeline
stages, a draft model) cannot hold two shapes, and says so."""

from __future__ import annotations

import pytest

from pagoda.engine_core.kv_groups import plan_layout

WINDOWS = [8, 8, None, 8, 8, None]


def test_one_shape_keeps_the_pool_as_it_was():
    layout = plan_layout(WINDOWS, range(6), True, [(2, 16)] * 6)
    assert layout.row_elements == 32
    assert [layout.block_scale(g) for g in range(len(layout.groups))] == [1] * len(layout.groups)


def test_two_shapes_share_a_row_of_their_least_common_multiple():
    shapes = [(2, 16), (2, 16), (1, 48), (2, 16)]
    layout = plan_layout(WINDOWS, [0, 1, 2, 3], True, shapes)
    assert [(g.window, g.layers, g.shape) for g in layout.groups] == [
        (8, (0,), (2, 16)),
        (8, (1,), (2, 16)),
        (8, (3,), (2, 16)),
        (None, (2,), (1, 48)),
    ]
    assert layout.slots == 1 and layout.row_elements == 96
    assert [layout.block_scale(g) for g in range(4)] == [3, 3, 3, 2]


def test_a_kind_splits_by_shape_too():
    """Layers of one window but two shapes go to different groups."""
    layout = plan_layout([None] * 4, range(4), True, [(2, 16), (4, 16), (2, 16), (4, 16)])
    assert [(g.layers, g.shape) for g in layout.groups] == [((0, 2), (2, 16)), ((1, 3), (4, 16))]
    assert [layout.block_scale(g) for g in range(2)] == [2, 1]


def test_one_group_of_two_shapes_is_refused():
    with pytest.raises(ValueError, match="pipeline parallel or a draft model"):
        plan_layout(WINDOWS, [0, 1, 2, 3], False, [(2, 16), (2, 16), (1, 48), (2, 16)])
