"""Async helpers of the server: merging the output streams of several prompts, taking the first output
before a response starts, and cancelling a non-streaming request whose client went away."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request

_END = object()


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(i, item) from every generator as items arrive; closing this closes (aborts) all of them."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001  (re-raised by the consumer)
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        async for pair in drain(queue, len(gens), _END):
            yield pair
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drain(queue: asyncio.Queue, sources: int, end=None):
    """The (source, item) pairs `sources` producers put on `queue`, until each has put (source, `end`); an
    exception put as an item is raised."""
    left = sources
    while left:
        i, item = await queue.get()
        if item is end:
            left -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield i, item


async def first_and_rest(stream: AsyncIterator):
    """The first item (awaited now, so that its errors come before any response) and the stream."""
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise
    return first, stream


async def until_disconnect(request: Request, work: Awaitable, poll_s: float = 0.5) -> bool:
    """Await `work`; False if the client disconnected first (then `work` is cancelled, which aborts its
    engine requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()  # and wait for it: its cleanup (the engine aborts) is issued before the response
            await asyncio.gather(task, return_exceptions=True)
