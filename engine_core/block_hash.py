"""Content hashes of full KV blocks, for the prefix cache.

A block's hash chains its parent's hash, its token ids and extra keys (the request's cache salt on
the first block, so the chain of every later block carries it too). It is SHA-256 over a canonical
msgpack encoding: never Python's `hash()`, which is salted per process and collides by design at
this scale. Equal hashes therefore mean equal token prefixes, so equal K/V.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    return hashlib.sha256(_encode((parent, list(token_ids), extra_keys))).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> None:
    """Append the hashes of the full blocks of `token_ids` that `hashes` does not cover yet."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = (cache_salt,) if index == 0 and cache_salt is not None else ()
        hashes.append(hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra))
