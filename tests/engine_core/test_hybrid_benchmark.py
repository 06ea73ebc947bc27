"""benchmarks/hybrid.py's memory method on a tiny Gemma 3 (its layer pattern, widths of 64): the blocks one
request holds in a real engine equal the benchmark's formula, with KV groups and all-global alike, and the
groups hold what the window predicts, a fraction of the all-global model's bytes."""

from __future__ import annotations

import pytest

from benchmarks.hybrid import gemma3_config, measure_kv, predicted_blocks

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
WINDOW = 40  # (not a whole number of blocks: the formula's rounding is tested)
CONTEXT, CHUNK, DECODE_STEPS = 300, 64, 3


@pytest.fixture(scope="module")
def rows() -> dict[bool, dict]:
    out = {}
    for all_global in (False, True):
        config = gemma3_config("1b", 1, all_global) | TINY | {"sliding_window": WINDOW}
        row = measure_kv(config, CONTEXT, CHUNK, DECODE_STEPS, threads=1)
        row["predicted"] = predicted_blocks(config["layer_types"], WINDOW, row["last_position"])
        out[all_global] = row
    return out


def test_blocks_held_equal_the_formula(rows):
    for row in rows.values():
        assert row["last_position"] == CONTEXT + DECODE_STEPS - 1
        assert row["held"] * row["slots"] == row["predicted"]  # (one block id holds `slots` layers)
        assert row["after_prefill"] >= row["held"] and row["peak"] >= row["after_prefill"]


def test_groups_hold_the_window_only(rows):
    grouped, full = rows[False], rows[True]
    assert grouped["layout"] == "5 sliding 40, 1 full (1 layer(s) each)"
    assert full["layout"] == "1 full (6 layer(s) each)"
    assert grouped["bytes_per_block"] * 6 == full["bytes_per_block"]
    ratio = grouped["held"] * grouped["bytes_per_block"] / (full["held"] * full["bytes_per_block"])
    tokens = CONTEXT + DECODE_STEPS
    assert ratio < 0.35  # (the ideal: (tokens + 5 x 40) / (6 x tokens) = 0.28, plus partly used blocks)
    assert ratio > (tokens + 5 * WINDOW) / (6 * tokens)
