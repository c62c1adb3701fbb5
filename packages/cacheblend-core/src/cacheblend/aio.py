"""Async access for framework adapters: the engine's work runs on worker threads so an
event loop is never blocked by a prefill or a decode step.

A thread cannot be stopped from outside, so a call whose awaiting task is cancelled (an
``asyncio.wait_for`` timeout, a client gone) is stopped from inside: :func:`run_in_thread`
hands the thread a cancel flag through a context variable (``asyncio.to_thread`` copies the
context), and the engine checks it between layers and between tokens
(:func:`raise_if_cancelled`), where it already checks a request's deadline.  Without it, a
cancelled ``ainvoke`` went on decoding to ``max_tokens`` on its thread."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
_DONE = object()
_CANCEL: ContextVar[threading.Event | None] = ContextVar("cacheblend_cancel", default=None)


class CallCancelled(BaseException):
    """The async call that started this work was cancelled.  A ``BaseException``, as
    ``asyncio.CancelledError`` is, so that no retry loop or ``except Exception`` takes it
    for a failure to retry."""


def raise_if_cancelled() -> None:
    """Raise :class:`CallCancelled` if the async call this thread works for was cancelled."""
    flag = _CANCEL.get()
    if flag is not None and flag.is_set():
        raise CallCancelled("the async call was cancelled")


def cancellable() -> bool:
    """Whether this thread works for an async call that can be cancelled."""
    return _CANCEL.get() is not None


async def run_in_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a worker thread; cancelling the awaiting task stops the
    engine's work at its next layer or token."""
    flag = threading.Event()
    token = _CANCEL.set(flag)
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except asyncio.CancelledError:
        flag.set()
        raise
    finally:
        _CANCEL.reset(token)


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of the iterator ``make()`` returns, each produced on a worker thread;
    cancelling the consumer stops the step under way (a whole prefill, for the first item)
    at its next layer or token, as :func:`run_in_thread` does.

    ``make`` itself runs on a thread too (starting a generation validates input and
    tokenizes); an exception it raises comes out of the first ``__anext__``."""
    flag = threading.Event()
    context = contextvars.copy_context()  # the threads' context: it holds the cancel flag
    context.run(_CANCEL.set, flag)
    try:
        it = await asyncio.to_thread(context.run, make)
    except asyncio.CancelledError:
        flag.set()
        raise
    def advance() -> object:
        return context.run(next, it, _DONE)

    step: asyncio.Future | None = None
    try:
        while True:
            # Shielded: a cancelled consumer must not abandon a step still running on its
            # thread, or closing the generator below would find it executing.
            step = asyncio.ensure_future(asyncio.to_thread(advance))
            try:
                item = await asyncio.shield(step)
            except asyncio.CancelledError:
                flag.set()  # the step stops at its next layer or token
                raise
            step = None
            if item is _DONE:
                return
            yield item  # type: ignore[misc]
    finally:
        if step is not None:  # cancelled mid-step: let the step stop, then close
            try:
                await step
            except (Exception, CallCancelled):
                pass
        close = getattr(it, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
