"""Work on stored chunks done off the request's critical path, one job per key at a time.

Two kinds of work leave a request without delaying its first token: precomputing a
passage first seen inside a prompt (*learning*: the prompt computed it in place, the next
one reuses it), and adding a deviation hint to an entry stored before hints existed (the
*hint backfill*: the prompt ran the full check, the next one checks the pool).  Both run on
one background thread, so they never take both cores from the requests; or, in vLLM's
worker, between forwards (:class:`StepExecutor`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future

log = logging.getLogger("cacheblend")

__all__ = ["KeyedJobs", "RETRY_AFTER_S", "StepExecutor"]

RETRY_AFTER_S = 600.0
"""How long a key whose job could not improve its entry waits before it is tried again: a
store mounted read-only at start may be writable an hour later, but trying on every lookup
would cost each prompt a job."""


class StepExecutor(Executor):
    """Runs submitted jobs only when :meth:`run_pending` is called, on the caller's thread.

    vLLM's worker multiplies with vLLM's own linear layers (:mod:`..integrations.vllm_model`),
    whose oneDNN matmuls on CPU share one process-wide scratchpad and unlocked primitive
    caches.  A background thread running them while vLLM's forward runs races on both: a
    hint backfill that overlapped a forward stored a hint that decoded to nothing, and
    vLLM's own outputs in that step were at the same risk.  The worker runs this work
    after each forward instead (:meth:`.ChunkCache.run_background_on`)."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[Future, Callable[..., object], tuple, dict]] = deque()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future:
        future: Future = Future()
        with self._lock:
            self._jobs.append((future, fn, args, kwargs))
        return future

    def run_pending(self) -> int:
        """Run every job queued so far (and any they queue); how many ran."""
        ran = 0
        while True:
            with self._lock:
                if not self._jobs:
                    return ran
                future, fn, args, kwargs = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
            ran += 1


class KeyedJobs:
    """Background jobs keyed by chunk, at most one pending per key.

    With ``retry_after`` (seconds), a key whose job returned False (the entry could not be
    improved: a read-only store, a chunk too long for the hint's filler) is not tried again
    until that long has passed, so a store that cannot take the result does not cost every
    lookup a job, and one that becomes writable later still gets it."""

    def __init__(self, executor: Executor, name: str, retry_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._executor, self.name, self.retry_after, self._clock = executor, name, retry_after, clock
        self._pending: dict[str, Future] = {}
        self._failed: dict[str, float] = {}  # key -> when its job last returned False
        self._lock = threading.Lock()

    def submit(self, key: str, job: Callable[[], object]) -> None:
        """Run ``job`` on the background thread unless ``key`` has one pending or failed
        less than ``retry_after`` seconds ago."""
        with self._lock:
            if key in self._pending:
                return
            failed_at = self._failed.get(key)
            if failed_at is not None and self.retry_after is not None:
                if self._clock() - failed_at < self.retry_after:
                    return
                del self._failed[key]
            self._pending[key] = self._executor.submit(self._run, key, job)

    def _run(self, key: str, job: Callable[[], object]) -> object:
        ok: object = None
        try:
            ok = job()
        except Exception:  # noqa: BLE001 - background work must never surface in a request
            log.warning("cacheblend: %s of chunk %s… failed; it is tried again on next use", self.name, key[:12],
                        exc_info=True)
        finally:
            with self._lock:
                self._pending.pop(key, None)
                if self.retry_after is not None and ok is False:
                    self._failed[key] = self._clock()
        return ok

    def use(self, executor: Executor) -> None:
        """Run later jobs on ``executor`` (those already submitted stay where they are)."""
        self._executor = executor

    def wait(self, key: str | None = None) -> None:
        """Wait until ``key``'s job (or every pending one) has finished; its errors were logged.
        Jobs of a :class:`StepExecutor` are run now, on this thread."""
        if isinstance(self._executor, StepExecutor):
            self._executor.run_pending()
        with self._lock:
            pending = [self._pending.get(key)] if key is not None else list(self._pending.values())
        for future in pending:
            if future is not None:
                future.exception()
