"""Several generate streams (one per prompt of a completions request) read as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from pagoda.engine_core.protocol import GenerateDelta

_DONE = object()


async def merge(streams: list[AsyncIterator[GenerateDelta]]) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(stream index, delta) in arrival order. The first error ends everything; leaving early (or being
    cancelled) closes every stream, which aborts its request in the engine."""
    if len(streams) == 1:  # the common case, without tasks
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    queue.put_nowait((index, delta))
            queue.put_nowait(_DONE)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
