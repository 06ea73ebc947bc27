"""JSON replies written in pieces: a large reply (a /pooling request's per-token vectors) never exists
as one bytes object, nor as one tree of Python floats.

Encoded whole, 256 inputs of 256 tokens' vectors were 25 M Python floats and then one 516 MB bytes
object: the HTTP worker grew from 68 MB to 1.9 GB, and kept 462 MB afterwards. Written one piece at a
time, each piece's floats are freed before the next is built, and the C heap's free pages go back to
the system once a large reply is out (`release_freed_memory`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiohttp import web

from pagoda.engine_core.host_memory import release_freed_memory

PIECE_BYTES = 1 << 20  # pieces are written once this much is gathered: few writes, little held at once
_TRIM_AFTER_BYTES = 16 << 20  # replies at least this large hand their freed memory back afterwards


async def send_json(request: web.Request, pieces: Iterable[bytes]) -> web.StreamResponse:
    """Answer 200 with the concatenation of `pieces` (together one JSON document), built lazily: a reply
    of one gathered piece goes out whole (with its Content-Length); a longer one is sent chunked as
    its pieces are built, the writer waiting while the client reads."""
    gathered: list[bytes] = []
    size = 0
    iterator = iter(pieces)
    for piece in iterator:
        gathered.append(piece)
        size += len(piece)
        if size >= PIECE_BYTES:
            break
    else:
        return web.Response(body=b"".join(gathered), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    total = size
    await response.write(b"".join(gathered))
    gathered, size = [], 0
    for piece in iterator:
        gathered.append(piece)
        size += len(piece)
        if size >= PIECE_BYTES:
            total += size
            await response.write(b"".join(gathered))
            gathered, size = [], 0
    total += size
    await response.write_eof(b"".join(gathered))
    if total >= _TRIM_AFTER_BYTES:
        # Once the handler has returned: until then its frames hold the engine's result (the vectors).
        asyncio.get_running_loop().call_soon(release_freed_memory)
    return response
