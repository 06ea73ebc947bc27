"""How deeply nested a JSON value may be: one limit for request bodies and for JSON schemas.

Parsers, validators and grammar compilers walk JSON recursively, so a value nested thousands of levels
deep ends in Python's RecursionError (or a C stack overflow) somewhere inside them. This module decides
first, with code that does not recurse: request bodies are measured before they are parsed
(`text_exceeds_depth`), already-parsed values before they are walked (`value_exceeds_depth`), and
anything deeper than `MAX_JSON_DEPTH` is refused with a 400 naming the field. Python's recursion limit
(about 1,000 frames) is never what decides.

64 levels leave room for realistic schemas: a request body spends 4 levels reaching
`response_format.json_schema.schema`, and each nested object in a schema takes 2 (`properties`, then the
property), so a schema may nest about 30 objects deep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import numpy as np

MAX_JSON_DEPTH = 64

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_STRING = re.compile(rb'"[^"]*"')  # strings once escaped quotes are gone: no backslash case left
_CHUNK = 1 << 20


def depth_message(where: str) -> str:
    return (
        f"'{where}' is nested too deeply: JSON values may be nested at most {MAX_JSON_DEPTH} levels "
        "deep (objects and arrays), counted from the outermost."
    )


def text_exceeds_depth(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text opens more than `limit` arrays/objects at some point (brackets inside
    strings do not count). Measured on the raw text in C-speed passes, so it is safe on any input of
    any size, valid JSON or not; an ordinary body costs two `bytes.count` calls."""
    return too_deep_field(text, limit) is not None


def too_deep_field(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """None if the JSON text nests at most `limit` levels deep; else the top-level object's field
    that holds the deepest part ("" when the top level is not an object)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if text.count(b"[") + text.count(b"{") <= limit:
        return None
    # Remove escaped backslashes, then escaped quotes: every quote left opens or closes a string.
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKETS)
    depth = 0
    steps = _STEP[np.frombuffer(brackets, dtype=np.uint8)]
    for start in range(0, len(steps), _CHUNK):  # chunks keep the running sums small in memory
        running = np.cumsum(steps[start : start + _CHUNK], dtype=np.int32) + depth
        if int(running.max()) > limit:
            return _field_at(unescaped, limit)
        depth = int(running[-1])
    return None


def _field_at(unescaped: bytes, limit: int) -> str:
    """The top-level field in which the nesting first passes `limit` (only called when it does)."""
    text = np.frombuffer(unescaped, dtype=np.uint8)
    parity = depth = member = 0  # quotes seen (mod 2), nesting, where the current top-level member began
    for start in range(0, len(text), _CHUNK):
        chunk = text[start : start + _CHUNK]
        quotes = np.cumsum(chunk == ord('"'), dtype=np.int64) + parity
        outside = (quotes & 1) == 0
        depths = np.cumsum(np.where(outside, _STEP[chunk], 0), dtype=np.int32) + depth
        # A top-level member starts after the object's "{" or after a "," at depth 1.
        starts = np.flatnonzero(outside & (depths == 1) & ((chunk == ord("{")) | (chunk == ord(","))))
        over = np.flatnonzero(depths > limit)
        if over.size:
            starts = starts[starts < over[0]]
        if starts.size:
            member = start + int(starts[-1])
        if over.size:
            break
        parity, depth = int(quotes[-1]) & 1, int(depths[-1])
    key = re.match(rb'\s*("[^"]{0,200}")\s*:', unescaped[member + 1 : member + 256])
    if key is None:
        return ""
    try:  # the key's own escapes (\u00e9), minus the escaped quotes and backslashes removed above
        return json.loads(key.group(1))
    except ValueError:
        return key.group(1)[1:-1].decode("utf-8", "replace")


def value_exceeds_depth(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed value (dicts, lists, scalars) nests more than `limit` containers deep.
    Iterative: safe on values built by any client, however deep."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return False
