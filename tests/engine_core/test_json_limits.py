"""The nesting limit: measured on raw JSON text without parsing it, exactly as a parser would see it."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.engine_core.json_limits import MAX_JSON_DEPTH, text_exceeds_depth, too_deep_field, value_exceeds_depth

# Strings full of brackets, quotes and backslashes: none of them may count as nesting.
TRICKY_TEXT = st.text(alphabet='[]{}"\\ab', max_size=12)
VALUES = st.recursive(
    st.none() | st.integers() | TRICKY_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TRICKY_TEXT, children, max_size=3),
    max_leaves=40,
)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(VALUES, st.integers(0, 8))
def test_text_and_value_checks_agree_with_the_real_depth(value, limit):
    expected = _depth(value) > limit
    assert text_exceeds_depth(json.dumps(value), limit) is expected
    assert text_exceeds_depth(json.dumps(value, indent=1), limit) is expected
    assert value_exceeds_depth(value, limit) is expected


def test_the_field_holding_the_deep_part_is_named():
    deep = "[" * 100 + "]" * 100
    body = f'{{"model": "m", "a": "[[[[{{{{\\"\\\\", "prompt": {deep}, "n": 1}}'
    assert too_deep_field(body) == "prompt"
    assert too_deep_field(f'{{"x": [1, 2], "messages": [{{"content": {deep}}}]}}') == "messages"
    assert too_deep_field(deep) == ""  # not an object at the top
    assert too_deep_field(json.dumps({"prompt": "[" * 1000})) is None  # brackets in a string


def test_limits_at_the_edge_and_on_huge_inputs():
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert not text_exceeds_depth(at_limit)
    assert text_exceeds_depth("[" + at_limit + "]")
    assert text_exceeds_depth("[" * 10_000_000)  # unbalanced and huge: still a plain answer
    wide = "[" + ",".join(["[1]"] * 1_000_000) + "]"  # a million brackets, two levels
    assert not text_exceeds_depth(wide)
    nested: list = []
    for _ in range(100_000):  # deeper than Python could recurse
        nested = [nested]
    assert value_exceeds_depth(nested) and not value_exceeds_depth([[1]] * 1000)
