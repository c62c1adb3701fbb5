"""Async access for framework adapters: the engine's work runs on worker threads so an
event loop is never blocked by a prefill or a decode step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def run_in_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a worker thread."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of the iterator ``make()`` returns, each produced on a worker thread.

    ``make`` itself runs on a thread too (starting a generation validates input and
    tokenizes); an exception it raises comes out of the first ``__anext__``."""
    it = await asyncio.to_thread(make)
    step: asyncio.Future | None = None
    try:
        while True:
            # Shielded: a cancelled consumer must not abandon a step still running on its
            # thread, or closing the generator below would find it executing.
            step = asyncio.ensure_future(asyncio.to_thread(next, it, _DONE))
            item = await asyncio.shield(step)
            step = None
            if item is _DONE:
                return
            yield item  # type: ignore[misc]
    finally:
        if step is not None:  # cancelled mid-step: let the step finish, then close
            with contextlib.suppress(Exception):
                await step
        close = getattr(it, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
